//! Segment planning rules of stable-diffusion.cpp's `docs/performance.md` on a synthetic model, one case per sentence.
//!
//! The synthetic model is a stack of N identical blocks (100 MiB of weights, 50 MiB of
//! workspace each) between a head (30 MiB, 40 MiB workspace) and a tail (20 MiB, 60 MiB
//! workspace): 850 MiB of weights for 8 blocks, and a monolithic workspace of 60 MiB (no
//! cut outputs, so merged workspaces are the largest part's). Expected figures are worked
//! out by hand in each case's comment from the rule it quotes.

use sd_sched::plan::{
    plan, Action, DeviceState, Estimate, Mode, ModuleGraph, Options, ParamGroup, PlanError, PlannedSegment, Reason,
    Replica, Schedule, Segment, Simulator, Transfer, Violation, MIB,
};

const M: u64 = MIB;

fn g(name: &str) -> String {
    format!("unet/{name}")
}

/// head, `n` blocks, tail.
fn stack(n: usize) -> ModuleGraph {
    let mut segments = vec![Segment::new("head", vec![ParamGroup::new(g("head"), 30 * M)], 40 * M)];
    for i in 0..n {
        let name = format!("block.{i}");
        segments.push(Segment::new(name.clone(), vec![ParamGroup::new(g(&name), 100 * M)], 50 * M));
    }
    segments.push(Segment::new("tail", vec![ParamGroup::new(g("tail"), 20 * M)], 60 * M));
    ModuleGraph { name: "unet".into(), segments }
}

fn budget(bytes: u64) -> DeviceState {
    DeviceState::new("CUDA0", Some(bytes), None)
}

fn free(bytes: u64) -> DeviceState {
    DeviceState::new("CUDA0", None, Some(bytes))
}

fn no_prefetch() -> Options {
    Options { disable_prefetch: true, ..Options::default() }
}

fn run(module: &ModuleGraph, device: &DeviceState, opts: Options) -> Schedule {
    plan(module, device, &opts, &mut Estimate).unwrap_or_else(|e| panic!("{e}"))
}

fn ranges(s: &Schedule) -> Vec<std::ops::Range<usize>> {
    s.segments.iter().map(|p| p.base.clone()).collect()
}

fn names<'a>(it: impl Iterator<Item = &'a str>) -> Vec<String> {
    it.map(str::to_string).collect()
}

fn replica(group: &str, bytes: u64, pinned: bool) -> Replica {
    Replica { group: group.to_string(), bytes, pinned }
}

/// Weights 850 MiB + workspace 60 MiB for 8 blocks: the monolithic need on an empty device.
const NEED8: u64 = 910 * M;
const H: u64 = 128 * M;
const RESERVE: u64 = 512 * M;

struct ModeCase {
    rule: &'static str,
    device: DeviceState,
    opts: Options,
    want: Mode,
    reason: Reason,
}

#[test]
fn monolithic_or_segmented() {
    let mut reusable = budget(60 * M + 850 * M + H);
    reusable.workspace = 60 * M;
    let mut shared = budget(NEED8 + H + 1024 * M + 300 * M);
    shared.fixed = 1024 * M;
    shared.replicas = vec![replica("te/all", 300 * M, true)];
    let mut shared_short = shared.clone();
    shared_short.budget = Some(NEED8 + H + 1024 * M + 300 * M - 1);
    let both = |b: u64, f: u64| DeviceState::new("CUDA0", Some(b), Some(f));
    let cases = [
        ModeCase {
            rule: "\"the runner requires an additional 128 MiB of headroom in ... any explicit managed budget\": \
                   need + 128 MiB exactly equal to the budget is monolithic",
            device: budget(NEED8 + H),
            opts: Options::default(),
            want: Mode::Monolithic,
            reason: Reason::Fits,
        },
        ModeCase {
            rule:
                "\"When a graph has cut markers and its missing weights plus incremental compute workspace exceed \
                   the available device headroom, it runs its fixed segment list in order\": one byte less is segmented",
            device: budget(NEED8 + H - 1),
            opts: Options::default(),
            want: Mode::Segmented,
            reason: Reason::ExceedsHeadroom,
        },
        ModeCase {
            rule: "\"128 MiB of headroom in both available device memory\" while \"preserving the 512 MiB device \
                   scratch reserve\": free = need + 128 MiB + 512 MiB is monolithic",
            device: free(NEED8 + H + RESERVE),
            opts: Options::default(),
            want: Mode::Monolithic,
            reason: Reason::Fits,
        },
        ModeCase {
            rule: "the same in free memory, one byte less: segmented",
            device: free(NEED8 + H + RESERVE - 1),
            opts: Options::default(),
            want: Mode::Segmented,
            reason: Reason::ExceedsHeadroom,
        },
        ModeCase {
            rule: "\"in both\": a generous budget does not help when free memory is one byte short",
            device: both(10 * NEED8, NEED8 + H + RESERVE - 1),
            opts: Options::default(),
            want: Mode::Segmented,
            reason: Reason::ExceedsHeadroom,
        },
        ModeCase {
            rule: "\"in both\": plenty of free memory does not help when the budget is one byte short",
            device: both(NEED8 + H - 1, 100 * NEED8),
            opts: Options::default(),
            want: Mode::Segmented,
            reason: Reason::ExceedsHeadroom,
        },
        ModeCase {
            rule:
                "\"A reusable monolithic compute buffer is not counted as a new allocation\": with the 60 MiB buffer \
                   already allocated (and counted in the budget), need = 850 MiB of weights fits 910 + 128 MiB \
                   exactly; counting the buffer again would need 60 MiB more",
            device: reusable,
            opts: Options::default(),
            want: Mode::Monolithic,
            reason: Reason::Fits,
        },
        ModeCase {
            rule: "\"An explicit --max-vram budget deducts already-resident managed weights and compute/cache buffers \
                   registered by every runner sharing the device\": 1 GiB of other runners' buffers and a pinned \
                   300 MiB replica are deducted; exactly at the edge it is monolithic",
            device: shared,
            opts: Options::default(),
            want: Mode::Monolithic,
            reason: Reason::Fits,
        },
        ModeCase {
            rule: "the same deduction, one byte short: \"later graph runs remain segmented when the full graph \
                   exceeds the budget\"",
            device: shared_short,
            opts: Options::default(),
            want: Mode::Segmented,
            reason: Reason::ExceedsHeadroom,
        },
        ModeCase {
            rule: "\"--disable-segmented-compute forces monolithic graph execution ... even when the automatic memory \
                   check would select segments\" (the 128 MiB planning headroom may be consumed)",
            device: budget(NEED8 + 64 * M),
            opts: Options { disable_segmented_compute: true, ..Options::default() },
            want: Mode::Monolithic,
            reason: Reason::Disabled,
        },
        ModeCase {
            rule: "segments only \"when a graph has cut markers\": a device with no budget and no free-memory figure \
                   (the CPU) is never segmented",
            device: DeviceState::new("CPU", None, None),
            opts: Options::default(),
            want: Mode::Monolithic,
            reason: Reason::Unbounded,
        },
    ];
    for c in cases {
        let s = run(&stack(8), &c.device, c.opts);
        assert_eq!((s.mode, s.decision.reason), (c.want, c.reason), "{}", c.rule);
        if c.want == Mode::Monolithic {
            assert_eq!(s.segments.len(), 1, "{}", c.rule);
            assert_eq!(s.segments[0].base, 0..10, "{}", c.rule);
        } else {
            assert!(s.segments.len() > 1, "{}", c.rule);
        }
    }
}

#[test]
fn reusable_buffer_is_not_reallocated() {
    // "A reusable monolithic compute buffer is not counted as a new allocation": no workspace
    // action, only the weights are loaded.
    let mut d = budget(60 * M + 850 * M + H);
    d.workspace = 60 * M;
    let s = run(&stack(8), &d, Options::default());
    assert!(!s.segments[0].actions.iter().any(|a| matches!(a, Action::Workspace { .. })));
    assert_eq!(s.transfer_bytes(), 850 * M);
    assert_eq!(s.decision.new_workspace, 0);
}

#[test]
fn merging_without_prefetch() {
    // "adjacent segments are merged while they fit" (issue 5 of this project's tracker, on
    // the fixed segment list of stable-diffusion.cpp's `docs/performance.md`). Budget 600 MiB,
    // so merged segments must fit 600 - 128 = 472 MiB:
    //   head+b0+b1+b2 = 330 weights + 50 workspace = 380; adding b3 gives 480 > 472.
    //   b3..b6 = 400 + 50 = 450; adding b7 gives 550.
    //   b7+tail = 120 + 60 = 180, the end.
    let s = run(&stack(8), &budget(600 * M), no_prefetch());
    assert_eq!(s.mode, Mode::Segmented);
    assert_eq!(ranges(&s), [0..4, 4..8, 8..10]);
    let n: Vec<_> = s.segments.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(n, ["head..block.2", "block.3..block.6", "block.7..tail"]);
    assert_eq!(s.peak_workspace(), 60 * M);
    // "--disable-prefetch disables asynchronous next-segment prefetch while retaining synchronous
    // loading, eviction, and segmented execution": every group is loaded by its own segment.
    assert_eq!(s.prefetches().count(), 0);
    for p in &s.segments {
        assert_eq!(names(p.loads()), p.groups, "{}", p.name);
        assert!(!p.prefetch_skipped);
    }
}

#[test]
fn merging_leaves_room_for_prefetch() {
    // With prefetch, a merged segment must fit 472 MiB next to a prefetch of its own weight:
    //   head+b0: 2*130 + 50 = 310; adding b1: 2*230 + 50 = 510 > 472.
    //   b1+b2: 2*200 + 50 = 450; adding b3: 650. Likewise b3+b4, b5+b6.
    //   b7+tail: 2*120 + 60 = 300.
    let s = run(&stack(8), &budget(600 * M), Options::default());
    assert_eq!(ranges(&s), [0..2, 2..4, 4..6, 6..8, 8..10]);
}

#[test]
fn prefetch_order() {
    // "the next parameter-bearing segment is prefetched when the device supports asynchronous
    // transfer": on an empty device with 600 MiB, each segment (at most 200 MiB of weights and
    // 60 MiB of workspace) fits next to the following one, so only the first loads
    // synchronously and every other segment's groups are prefetched by its predecessor.
    let s = run(&stack(8), &budget(600 * M), Options::default());
    let want: [&[&str]; 5] =
        [&["block.1", "block.2"], &["block.3", "block.4"], &["block.5", "block.6"], &["block.7", "tail"], &[]];
    for (i, (p, w)) in s.segments.iter().zip(want).enumerate() {
        let w: Vec<String> = w.iter().map(|n| g(n)).collect();
        assert_eq!(names(p.prefetches()), w, "{}", p.name);
        for a in &p.actions {
            if let Action::Prefetch { for_segment, via, .. } = a {
                assert_eq!((*for_segment, *via), (i + 1, Transfer::Async));
            }
        }
        // The prefetch is issued before the segment computes, so that it overlaps.
        let pos = |f: fn(&Action) -> bool| p.actions.iter().position(f);
        if let Some(pf) = pos(|a| matches!(a, Action::Prefetch { .. })) {
            assert!(pf < pos(|a| matches!(a, Action::Compute)).unwrap());
        }
    }
    assert_eq!(names(s.segments[0].loads()), [g("head"), g("block.0")]);
    assert!(s.segments[1..].iter().all(|p| p.loads().count() == 0));

    // "asynchronously where the device supports it, on a worker thread otherwise" (issue 5 of
    // this project's tracker).
    let mut d = budget(600 * M);
    d.async_transfer = false;
    let s = run(&stack(8), &d, Options::default());
    assert!(s.segments.iter().flat_map(|p| &p.actions).all(|a| match a {
        Action::Prefetch { via, .. } => *via == Transfer::WorkerThread,
        _ => true,
    }));
    assert_eq!(s.prefetches().count(), 8);
}

#[test]
fn prefetch_skipped_when_it_does_not_fit() {
    // Four 300 MiB blocks with 50 MiB workspace under 600 MiB: each fits alone (350), none
    // merges (650 > 472), and the next block's 300 MiB cannot sit next to the current one
    // (300 + 50 + 300 = 650 > 600): nothing is prefetched, each block loads its own weights.
    let segments = (0..4)
        .map(|i| Segment::new(format!("b{i}"), vec![ParamGroup::new(format!("m/b{i}"), 300 * M)], 50 * M))
        .collect();
    let m = ModuleGraph { name: "m".into(), segments };
    let s = run(&m, &budget(600 * M), Options::default());
    assert_eq!(ranges(&s), [0..1, 1..2, 2..3, 3..4]);
    assert_eq!(s.prefetches().count(), 0);
    let skipped: Vec<bool> = s.segments.iter().map(|p| p.prefetch_skipped).collect();
    assert_eq!(skipped, [true, true, true, false]);
    for p in &s.segments {
        assert_eq!(names(p.loads()), p.groups);
    }
    // With 650 MiB it fits, and blocks 1..3 are prefetched.
    let s = run(&m, &budget(650 * M), Options::default());
    assert_eq!(names(s.prefetches()), ["m/b1", "m/b2", "m/b3"]);
}

#[test]
fn prefetch_targets_the_next_parameter_bearing_segment() {
    // "the next parameter-bearing segment is prefetched": segment 1 has no parameters (300 MiB
    // of workspace), so segment 0 prefetches segment 2's weights. They stay pinned across
    // segment 1, so the prefetch is made only if segment 1 still fits next to them:
    //   budget 420: 100 (B) + 300 (workspace) = 400 <= 420, prefetched;
    //   budget 350: 400 > 350, not prefetched, and B is loaded by segment 2 itself.
    // (Merging: 100 + 300 exceeds both budgets less 128 MiB; the whole graph needs 500.)
    let m = ModuleGraph {
        name: "m".into(),
        segments: vec![
            Segment::new("s0", vec![ParamGroup::new("m/a", 100 * M)], 10 * M),
            Segment::new("s1", vec![], 300 * M),
            Segment::new("s2", vec![ParamGroup::new("m/b", 100 * M)], 10 * M),
        ],
    };
    let s = run(&m, &budget(420 * M), Options::default());
    assert_eq!(ranges(&s), [0..1, 1..2, 2..3]);
    assert_eq!(names(s.segments[0].prefetches()), ["m/b"]);
    assert!(matches!(
        s.segments[0].actions.iter().find(|a| matches!(a, Action::Prefetch { .. })),
        Some(Action::Prefetch { for_segment: 2, .. })
    ));
    assert_eq!(s.segments[2].loads().count(), 0);
    Simulator::new(budget(420 * M)).replay(&m, &s, &mut Estimate).unwrap();

    let s = run(&m, &budget(350 * M), Options::default());
    assert_eq!(s.prefetches().count(), 0);
    assert!(s.segments[0].prefetch_skipped);
    assert_eq!(names(s.segments[2].loads()), ["m/b"]);
    Simulator::new(budget(350 * M)).replay(&m, &s, &mut Estimate).unwrap();
}

#[test]
fn eviction_goes_from_the_last_segment_backward() {
    // "automatic graph-cut execution evicts them from the last segment backward when the next
    // weight or compute allocation needs space" and "The current segment's weights are pinned".
    // A previous step left block.3..block.7 and the tail resident (520 MiB), plus an unpinned
    // replica of another module (te/x, 50 MiB, not used by this graph: reclaimed first) and a
    // pinned one (vae/y, never evicted). Budget 600 + 50 + 40 MiB.
    let mut d = budget(690 * M);
    d.replicas = vec![replica("te/x", 50 * M, false), replica("vae/y", 40 * M, true)];
    for n in ["block.3", "block.4", "block.5", "block.6", "block.7"] {
        d.replicas.push(replica(&g(n), 100 * M, false));
    }
    d.replicas.push(replica(&g("tail"), 20 * M, false));
    let s = run(&stack(8), &d, no_prefetch());
    // Capacity: 690 - 40 pinned = 650; merge limit 522: head..b2 = 380 (+b3 = 480 <= 522,
    // +b4 = 580): head..block.3; then block.4..tail = 420 weights + 60 workspace = 480.
    assert_eq!(ranges(&s), [0..5, 5..10]);
    // Segment 0 needs head, b0, b1, b2 (330 MiB) and 50 MiB workspace = 380 MiB; block.3 is
    // resident and pinned. Free now: 690 - 610 = 80. te/x first (130), then the tail (150),
    // block.7 (250), block.6 (350), block.5 (450 >= 380).
    assert_eq!(
        names(s.segments[0].evictions()),
        ["te/x".to_string(), g("tail"), g("block.7"), g("block.6"), g("block.5")]
    );
    // Segment 1 needs block.5..7 and the tail back (320 MiB; block.4 is resident and pinned)
    // and 10 MiB more workspace. Free: 690 - (40 + 430 + 100 + 50) = 70. From the last segment
    // backward, skipping its own groups: block.3 (170), block.2 (270), block.1 (370 >= 330).
    assert_eq!(names(s.segments[1].evictions()), [g("block.3"), g("block.2"), g("block.1")]);
    for p in &s.segments {
        for e in p.evictions() {
            assert!(!p.groups.iter().any(|x| x == e), "{} evicts its own {e}", p.name);
            assert_ne!(e, "vae/y");
        }
    }
    // The simulator agrees: nothing pinned evicted, budget respected.
    let mut sim = Simulator::new(d.clone());
    let report = sim.replay(&stack(8), &s, &mut Estimate).unwrap();
    assert!(report.high_water <= 690 * M);
}

#[test]
fn leading_segments_stay_resident_across_steps() {
    // "Unpinned replicas remain resident for reuse", evicted "from the last segment backward":
    // with 600 MiB, the leading segment (head + block.0 = 130 MiB) fits next to the two
    // segments being streamed (at most 2 x 200 MiB + 60 MiB workspace = 460; 590 <= 600), so
    // after the first sampling step it is never loaded again.
    let m = stack(8);
    let mut sim = Simulator::new(budget(600 * M));
    let mut transfers = Vec::new();
    for step in 0..4 {
        let (s, r) = sim.run(&m, &Options::default(), &mut Estimate).unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(s.mode, Mode::Segmented);
        if step > 0 {
            for moved in r.loaded.iter().chain(&r.prefetched) {
                assert!(moved != &g("head") && moved != &g("block.0"), "step {step} reloads {moved}");
            }
        }
        assert!(s.segments[0].stays_resident, "step {step}");
        assert!(r.high_water <= 600 * M);
        transfers.push(r.transferred());
    }
    // Every group is copied exactly once in the first step.
    assert_eq!(transfers[0], 850 * M);
    assert!(transfers[1..].iter().all(|&t| t < 850 * M), "{transfers:?}");
    assert!(sim.high_water() <= 600 * M);
}

#[test]
fn everything_fits_after_the_first_step() {
    // 1038 MiB less one byte is one byte short of need + 128 MiB, so the first step is
    // segmented; all the weights plus the largest workspace (910 MiB) fit, so nothing is ever
    // evicted and the next steps transfer nothing. They stay segmented: "later graph runs
    // remain segmented when the full graph exceeds the budget" (the full graph still needs its
    // 128 MiB planning headroom, which the resident weights now take).
    let m = stack(8);
    let mut sim = Simulator::new(budget(NEED8 + H - 1));
    let (s, r) = sim.run(&m, &Options::default(), &mut Estimate).unwrap();
    assert_eq!(s.mode, Mode::Segmented);
    assert_eq!((r.transferred(), r.evicted_bytes), (850 * M, 0));
    assert!(s.segments.iter().all(|p| p.stays_resident));
    for _ in 0..3 {
        let (s, r) = sim.run(&m, &Options::default(), &mut Estimate).unwrap();
        assert_eq!((s.mode, r.transferred(), r.evicted_bytes), (Mode::Segmented, 0, 0));
    }
    // A budget with the headroom to spare runs whole from the start and then reuses everything.
    let mut sim = Simulator::new(budget(NEED8 + H));
    for step in 0..3 {
        let (s, r) = sim.run(&m, &Options::default(), &mut Estimate).unwrap();
        assert_eq!((s.mode, r.transferred()), (Mode::Monolithic, if step == 0 { 850 * M } else { 0 }));
    }
}

#[test]
fn monolithic_reclaims_unpinned_replicas_first() {
    // "Single-device monolithic execution also reclaims unpinned weight replicas before loading
    // weights or allocating compute workspace, including graphs without cut markers and runs
    // with --disable-segmented-compute."
    // Two 200 MiB replicas of another module (te/a, te/b; unpinned) and budget 1238 MiB:
    // available = 1238 - 400 + 400 = 1238 >= 910 + 128, so monolithic; free now 838 < 910, so
    // te/a is evicted (1038 >= 910) and te/b stays.
    let mut d = budget(1238 * M);
    d.replicas = vec![replica("te/a", 200 * M, false), replica("te/b", 200 * M, false)];
    let s = run(&stack(8), &d, Options::default());
    assert_eq!(s.mode, Mode::Monolithic);
    let p: &PlannedSegment = &s.segments[0];
    assert_eq!(names(p.evictions()), ["te/a"]);
    assert!(matches!(p.actions[0], Action::Evict { .. }), "reclaims before it allocates");
    // With 1038 MiB both go.
    d.budget = Some(1038 * M);
    let s = run(&stack(8), &d, Options::default());
    assert_eq!(names(s.segments[0].evictions()), ["te/a", "te/b"]);

    // A graph without cut markers, and a forced monolithic run, reclaim too. Budget 1000 MiB:
    // need 910 fits the available 1000 but not with the 128 MiB headroom; free now 600, so
    // both replicas go.
    d.budget = Some(1000 * M);
    let one = ModuleGraph {
        name: "vae".into(),
        segments: vec![Segment::new("decoder", vec![ParamGroup::new("vae/decoder", 800 * M)], 110 * M)],
    };
    let s = run(&one, &d, Options::default());
    assert_eq!((s.mode, s.decision.reason), (Mode::Monolithic, Reason::NoCuts));
    assert_eq!(names(s.segments[0].evictions()), ["te/a", "te/b"]);
    let forced = Options { disable_segmented_compute: true, ..Options::default() };
    let s = run(&stack(8), &d, forced);
    assert_eq!((s.mode, s.decision.reason), (Mode::Monolithic, Reason::Disabled));
    assert_eq!(names(s.segments[0].evictions()), ["te/a", "te/b"]);
    let report = Simulator::new(d).replay(&stack(8), &s, &mut Estimate).unwrap();
    assert_eq!(report.high_water, NEED8);
}

#[test]
fn forced_monolithic_fails_cleanly() {
    // "It still respects the managed device budget and fails if the graph cannot fit after
    // reclamation": 910 MiB in a 600 MiB budget.
    let err = plan(
        &stack(8),
        &budget(600 * M),
        &Options { disable_segmented_compute: true, ..Options::default() },
        &mut Estimate,
    )
    .unwrap_err();
    match &err {
        PlanError::DoesNotFit(f) => {
            let (what, needed, available, budget) = (&f.what, &f.needed, &f.available, &f.budget);
            assert_eq!(what, "the whole graph");
            assert_eq!((*needed, *available, *budget), (NEED8, 600 * M, Some(600 * M)));
        }
        e => panic!("{e}"),
    }
    let msg = err.to_string();
    for part in ["CUDA0", "954204160 bytes", "600.0 MiB", "segmented execution is disabled"] {
        assert!(msg.contains(part), "{part} not in: {msg}");
    }
    // A graph without cuts cannot fall back to segments either.
    let one = ModuleGraph {
        name: "vae".into(),
        segments: vec![Segment::new("decoder", vec![ParamGroup::new("vae/decoder", 800 * M)], 110 * M)],
    };
    let msg = plan(&one, &budget(900 * M), &Options::default(), &mut Estimate).unwrap_err().to_string();
    assert!(msg.contains("no cut markers") && msg.contains("954204160"), "{msg}");
    // 910 MiB in 910 MiB: the planning headroom is consumed, it runs.
    let s = run(&one, &budget(910 * M), Options::default());
    assert_eq!(s.mode, Mode::Monolithic);
}

#[test]
fn a_segment_that_cannot_fit_names_device_bytes_and_budget() {
    // Issue 5 of this project's tracker: "an allocation that still does not fit after
    // reclaiming fails with a message naming the device, the bytes needed and the budget".
    // block.3 is 700 MiB: with its 50 MiB workspace it needs 786432000 bytes; the budget is
    // 600 MiB.
    let mut m = stack(8);
    m.segments[4].groups[0].bytes = 700 * M;
    let err = plan(&m, &budget(600 * M), &Options::default(), &mut Estimate).unwrap_err();
    let msg = err.to_string();
    for part in ["CUDA0", "segment `block.3`", "786432000 bytes", "managed budget 600.0 MiB", "unet"] {
        assert!(msg.contains(part), "{part} not in: {msg}");
    }
    // Free memory: the reserve is named too.
    let msg = plan(&m, &free(1000 * M), &Options::default(), &mut Estimate).unwrap_err().to_string();
    assert!(msg.contains("512.0 MiB scratch reserve") && msg.contains("488.0 MiB"), "{msg}");
}

#[test]
fn cut_buffers_count_while_they_live() {
    // A UNet-like list: in0, in1, mid, out1, out0, where in_k's output is read last by out_k
    // (a skip connection, 10 MiB each) and each segment's output feeds the next (8 MiB).
    let names = ["in0", "in1", "mid", "out1", "out0"];
    let mut segments: Vec<Segment> =
        names.iter().map(|n| Segment::new(*n, vec![ParamGroup::new(format!("u/{n}"), 100 * M)], 20 * M)).collect();
    segments[0] = segments[0].clone().with_cut_output(10 * M, 4);
    segments[1] = segments[1].clone().with_cut_output(10 * M, 3);
    segments[2] = segments[2].clone().with_cut_output(8 * M, 3);
    segments[3] = segments[3].clone().with_cut_output(8 * M, 4);
    let m = ModuleGraph { name: "u".into(), segments };
    // out1 alone: 100 weights + 20 workspace + 28 of cut buffers live (in0's and in1's skips,
    // mid's output) + 8 it writes for out0 = 156 MiB, the largest. With 155 MiB it cannot
    // run, and the message counts the cut buffers.
    let err = plan(&m, &budget(155 * M), &no_prefetch(), &mut Estimate).unwrap_err();
    match err {
        PlanError::DoesNotFit(f) => {
            assert_eq!(f.what, "segment `out1`");
            assert_eq!((f.cuts, f.needed), (36 * M, 156 * M));
        }
        e => panic!("{e}"),
    }
    // With 156 MiB every segment runs alone (156 - 128 leaves no room to merge), and the
    // simulator checks that the live cut buffers are allocated when each segment computes and
    // all released at the end.
    let mut sim = Simulator::new(budget(156 * M));
    for _ in 0..2 {
        let (s, _) = sim.run(&m, &no_prefetch(), &mut Estimate).unwrap();
        assert_eq!(s.segments.len(), 5);
    }
    // With a larger budget some merge; merged-away cut buffers disappear and it still replays.
    for mib in [300, 400, 500, 600] {
        let mut sim = Simulator::new(budget(mib * M));
        for _ in 0..3 {
            sim.run(&m, &Options::default(), &mut Estimate).unwrap();
        }
    }
}

#[test]
fn the_simulator_catches_broken_schedules() {
    // The checks that the other tests rely on can fail.
    let m = stack(8);
    let d = budget(600 * M);
    let s = run(&m, &d, no_prefetch());
    let replay = |s: &Schedule| Simulator::new(d.clone()).replay(&m, s, &mut Estimate);
    assert!(replay(&s).is_ok());

    // Dropping the evictions of the second segment overflows the budget.
    let mut bad = s.clone();
    bad.segments[1].actions.retain(|a| !matches!(a, Action::Evict { .. }));
    assert!(matches!(replay(&bad), Err(Violation::OverBudget { .. })), "{:?}", replay(&bad));
    // Dropping a load leaves a segment without its weights.
    let mut bad = s.clone();
    let pos = bad.segments[2].actions.iter().position(|a| matches!(a, Action::Load { .. })).unwrap();
    bad.segments[2].actions.remove(pos);
    assert!(matches!(replay(&bad), Err(Violation::NotResident { .. })));
    // Evicting the current segment's own weights.
    let mut bad = s.clone();
    let first = bad.segments[1].groups[0].clone();
    let at = bad.segments[1].actions.len() - 1;
    bad.segments[1].actions.insert(at, Action::Evict { group: first, bytes: 100 * M });
    assert!(matches!(replay(&bad), Err(Violation::EvictPinned { .. })), "{:?}", replay(&bad));
    // A too-small workspace.
    let mut bad = s.clone();
    bad.segments[0].actions.retain(|a| !matches!(a, Action::Workspace { .. }));
    assert!(matches!(replay(&bad), Err(Violation::WorkspaceTooSmall { .. })));
    // Free memory dipping into the scratch reserve.
    let f = free(600 * M + RESERVE);
    let s = run(&m, &f, no_prefetch());
    assert!(Simulator::new(f.clone()).replay(&m, &s, &mut Estimate).is_ok());
    let mut tight = Simulator::new(f);
    tight.take_free(100 * M);
    assert!(matches!(tight.replay(&m, &s, &mut Estimate), Err(Violation::IntoReserve { .. })));
}

#[test]
fn invalid_input_is_an_error() {
    let mut m = stack(2);
    m.segments[2].groups.push(ParamGroup::new(g("head"), 31 * M));
    let msg = plan(&m, &budget(GIB_10), &Options::default(), &mut Estimate).unwrap_err().to_string();
    assert!(msg.contains("unet/head") && msg.contains("one size"), "{msg}");
    let mut m = stack(2);
    m.segments[1] = m.segments[1].clone().with_cut_output(M, 1);
    let msg = plan(&m, &budget(GIB_10), &Options::default(), &mut Estimate).unwrap_err().to_string();
    assert!(msg.contains("block.0") && msg.contains("read last by segment 1"), "{msg}");
    let empty = ModuleGraph { name: "x".into(), segments: vec![] };
    assert!(plan(&empty, &budget(GIB_10), &Options::default(), &mut Estimate).is_err());
}

const GIB_10: u64 = 10 << 30;
