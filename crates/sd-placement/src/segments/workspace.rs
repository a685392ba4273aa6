//! The compute workspace of merged segments: measured by the executor or estimated from the parts.

use std::ops::Range;

use super::model::Segment;

/// The compute workspace of segments `range` merged into one graph.
///
/// The executor implements it by building the merged graph and measuring it with ggml's
/// measure-only allocator (caching by range); `range` over the whole list is the monolithic
/// graph. Closures `FnMut(&[Segment], Range<usize>) -> u64` implement it too.
pub trait MergedWorkspace {
    /// Bytes of workspace the merged graph of `segments[range]` needs.
    fn merged(&mut self, segments: &[Segment], range: Range<usize>) -> u64;
}

impl<F: FnMut(&[Segment], Range<usize>) -> u64> MergedWorkspace for F {
    fn merged(&mut self, segments: &[Segment], range: Range<usize>) -> u64 {
        self(segments, range)
    }
}

/// The plain-data estimate: ggml's allocator reuses memory between the parts of a merged
/// graph, so its peak is the largest part's own workspace plus the outputs of earlier parts
/// still live at that part (read by it or after it, inside or beyond the range).
#[derive(Clone, Copy, Debug, Default)]
pub struct Estimate;

impl MergedWorkspace for Estimate {
    fn merged(&mut self, segments: &[Segment], range: Range<usize>) -> u64 {
        let start = range.start;
        range
            .map(|i| {
                let carried = segments[start..i]
                    .iter()
                    .flat_map(|s| &s.cut_outputs)
                    .filter(|c| c.last_reader >= i)
                    .map(|c| c.bytes)
                    .fold(0, u64::saturating_add);
                segments[i].workspace.saturating_add(carried)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(ws: u64) -> Segment {
        Segment::new("s", vec![], ws)
    }

    #[test]
    fn single_segment_is_its_own_workspace() {
        let segs = [seg(10), seg(30), seg(20)];
        for i in 0..3 {
            assert_eq!(Estimate.merged(&segs, i..i + 1), segs[i].workspace);
        }
    }

    #[test]
    fn merged_peak_adds_outputs_live_across_parts() {
        // 0 writes 5 bytes read last by 2; 1 writes 7 bytes read by 2 only.
        let segs = [seg(10).with_cut_output(5, 2), seg(30).with_cut_output(7, 2), seg(20)];
        // Part 1: 30 + 5 (from part 0, still needed by 2) = 35; part 2: 20 + 5 + 7 = 32.
        assert_eq!(Estimate.merged(&segs, 0..3), 35);
        // Starting at 1: part 1 alone 30, part 2: 20 + 7 = 27 (part 0's output lives outside).
        assert_eq!(Estimate.merged(&segs, 1..3), 30);
        // An output read only before a part does not count at that part.
        let segs = [seg(10).with_cut_output(50, 1), seg(1), seg(40)];
        assert_eq!(Estimate.merged(&segs, 0..3), 51);
    }

    #[test]
    fn closures_measure() {
        let segs = [seg(1), seg(2)];
        let mut calls = Vec::new();
        let mut m = |_: &[Segment], r: Range<usize>| {
            calls.push(r.clone());
            99
        };
        assert_eq!(MergedWorkspace::merged(&mut m, &segs, 0..2), 99);
        assert_eq!(calls, vec![(0..2)]);
    }
}
