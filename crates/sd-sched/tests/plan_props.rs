//! Property tests of segment planning: budgets never exceeded, weights resident while they
//! compute, failures exactly when a segment (or a forced whole graph) cannot fit.
//!
//! Random modules (segments with zero to three parameter groups, some groups shared with the
//! previous segment, random workspaces and cut outputs) on random devices (budget and/or free
//! memory, other runners' bytes, foreign and own replicas, pinned or not, a reusable buffer)
//! with random flags. Each plan is replayed for three runs by the simulator, which checks
//! every action on its own ledger. Whether planning must fail is decided here from the rules,
//! independently of the planner.

use std::collections::HashSet;

use proptest::prelude::*;
use sd_sched::plan::{
    plan, DeviceState, Estimate, MergedWorkspace, Mode, ModuleGraph, Options, ParamGroup, PlanError, Reason, Replica,
    Segment, Simulator, MIB,
};

const M: u64 = MIB;

#[derive(Clone, Debug)]
struct SegSpec {
    groups: Vec<u64>,
    share_previous: bool,
    workspace: u64,
    cut: Option<(u64, usize)>,
}

#[derive(Clone, Debug)]
struct Case {
    segs: Vec<SegSpec>,
    /// Per mille of the module's size (weights, largest workspace, cut outputs), above the
    /// other runners' bytes; likewise free memory above the scratch reserve.
    budget: Option<u64>,
    free: Option<u64>,
    fixed: u64,
    foreign: Vec<(u64, bool)>,
    /// Per graph group: no replica, unpinned replica, pinned replica.
    own: Vec<u8>,
    workspace: u64,
    opts: Options,
    async_transfer: bool,
}

fn seg_spec() -> impl Strategy<Value = SegSpec> {
    (prop::collection::vec(0..300 * M, 0..4), any::<bool>(), 0..150 * M, prop::option::of((0..40 * M, 1usize..4)))
        .prop_map(|(groups, share_previous, workspace, cut)| SegSpec { groups, share_previous, workspace, cut })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(seg_spec(), 1..12),
        prop::option::weighted(0.85, 50u64..1300),
        prop::option::weighted(0.6, 50u64..1500),
        0..300 * M,
        prop::collection::vec((0..200 * M, any::<bool>()), 0..3),
        prop::collection::vec(prop_oneof![6 => Just(0u8), 3 => Just(1u8), 1 => Just(2u8)], 40),
        prop_oneof![Just(0), 0..200 * M],
        (prop::bool::weighted(0.15), any::<bool>(), any::<bool>()),
    )
        .prop_map(|(segs, budget, free, fixed, foreign, own, workspace, (a, b, c))| Case {
            segs,
            budget,
            free,
            fixed,
            foreign,
            own,
            workspace,
            opts: Options { disable_segmented_compute: a, disable_prefetch: b },
            async_transfer: c,
        })
}

fn build(c: &Case) -> (ModuleGraph, DeviceState) {
    let n = c.segs.len();
    let mut segments: Vec<Segment> = Vec::new();
    let mut last_group: Option<ParamGroup> = None;
    for (i, s) in c.segs.iter().enumerate() {
        let mut groups: Vec<ParamGroup> =
            s.groups.iter().enumerate().map(|(k, b)| ParamGroup::new(format!("m/s{i}.g{k}"), *b)).collect();
        if s.share_previous {
            if let Some(g) = &last_group {
                groups.push(g.clone());
            }
        }
        if let Some(g) = groups.last() {
            last_group = Some(g.clone());
        }
        let mut seg = Segment::new(format!("s{i}"), groups, s.workspace);
        if let Some((bytes, offset)) = s.cut {
            if i + offset < n {
                seg = seg.with_cut_output(bytes, i + offset);
            }
        }
        segments.push(seg);
    }
    let module = ModuleGraph { name: "m".into(), segments };
    let size: u64 = {
        let mut seen = HashSet::new();
        let s = &module.segments;
        s.iter().flat_map(|s| &s.groups).filter(|g| seen.insert(g.name.clone())).map(|g| g.bytes).sum::<u64>()
            + s.iter().map(|s| s.workspace).max().unwrap_or(0)
            + s.iter().flat_map(|s| &s.cut_outputs).map(|c| c.bytes).sum::<u64>()
    };
    let others = c.fixed + c.foreign.iter().map(|(b, _)| b).sum::<u64>();
    let budget = c.budget.map(|pm| others + size / 1000 * pm);
    let free = c.free.map(|pm| 512 * M + size / 1000 * pm);
    let mut d = DeviceState::new("DEV0", budget, free);
    d.fixed = c.fixed;
    d.workspace = c.workspace;
    d.async_transfer = c.async_transfer;
    for (k, (bytes, pinned)) in c.foreign.iter().enumerate() {
        d.replicas.push(Replica { group: format!("other/g{k}"), bytes: *bytes, pinned: *pinned });
    }
    let mut seen = HashSet::new();
    let mut k = 0;
    for s in &module.segments {
        for g in &s.groups {
            if seen.insert(g.name.clone()) {
                match c.own[k % c.own.len()] {
                    1 => d.replicas.push(Replica { group: g.name.clone(), bytes: g.bytes, pinned: false }),
                    2 => d.replicas.push(Replica { group: g.name.clone(), bytes: g.bytes, pinned: true }),
                    _ => {}
                }
                k += 1;
            }
        }
    }
    (module, d)
}

/// Whether planning must fail, from the rules (not from the planner's code): a whole-graph
/// run fails when missing weights plus new workspace exceed the available headroom; a
/// segmented run fails when one segment's unpinned weights, workspace and live cut buffers
/// exceed what the runner could hold after reclaiming every unpinned replica.
fn must_fail(m: &ModuleGraph, d: &DeviceState, opts: &Options) -> bool {
    let n = m.segments.len();
    let mut groups: Vec<&ParamGroup> = Vec::new();
    for s in &m.segments {
        for g in &s.groups {
            if !groups.iter().any(|x| x.name == g.name) {
                groups.push(g);
            }
        }
    }
    let has = |name: &str| d.replicas.iter().find(|r| r.group == name);
    let managed: u64 = d.fixed + d.workspace + d.replicas.iter().map(|r| r.bytes).sum::<u64>();
    let reclaimable: u64 =
        d.replicas.iter().filter(|r| !r.pinned && !groups.iter().any(|g| g.name == r.group)).map(|r| r.bytes).sum();
    let full_ws = if n == 1 { m.segments[0].workspace } else { Estimate.merged(&m.segments, 0..n) };
    let need: u64 = groups.iter().filter(|g| has(&g.name).is_none()).map(|g| g.bytes).sum::<u64>()
        + full_ws.saturating_sub(d.workspace);
    let avail = [
        d.free.map(|f| (f + reclaimable).saturating_sub(d.scratch_reserve)),
        d.budget.map(|b| (b + reclaimable).saturating_sub(managed)),
    ]
    .into_iter()
    .flatten()
    .min();
    let Some(avail) = avail else { return false };
    if need + d.planning_headroom <= avail {
        return false;
    }
    if n == 1 || opts.disable_segmented_compute {
        return need > avail;
    }
    let pinned: u64 = d.replicas.iter().filter(|r| r.pinned).map(|r| r.bytes).sum();
    let unpinned: u64 = d.replicas.iter().filter(|r| !r.pinned).map(|r| r.bytes).sum();
    let cap = [
        d.free.map(|f| (f + d.workspace + unpinned).saturating_sub(d.scratch_reserve)),
        d.budget.map(|b| b.saturating_sub(d.fixed + pinned)),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap();
    (0..n).any(|i| {
        let s = &m.segments[i];
        let mut seen = HashSet::new();
        let weights: u64 = s
            .groups
            .iter()
            .filter(|g| seen.insert(g.name.clone()) && !has(&g.name).is_some_and(|r| r.pinned))
            .map(|g| g.bytes)
            .sum();
        let live_in: u64 =
            m.segments[..i].iter().flat_map(|p| &p.cut_outputs).filter(|c| c.last_reader >= i).map(|c| c.bytes).sum();
        let out: u64 = s.cut_outputs.iter().map(|c| c.bytes).sum();
        weights + s.workspace + live_in + out > cap
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn budgets_hold_and_weights_are_resident(c in case()) {
        check(c)?;
    }
}

/// The property of `budgets_hold_and_weights_are_resident` for one case.
fn check(c: Case) -> Result<(), TestCaseError> {
    let (m, d) = build(&c);
    let first = plan(&m, &d, &c.opts, &mut Estimate);
    // Deterministic.
    prop_assert_eq!(&first, &plan(&m, &d, &c.opts, &mut Estimate));
    prop_assert_eq!(first.is_err(), must_fail(&m, &d, &c.opts), "{:?}", first);
    match first {
        Err(PlanError::DoesNotFit(f)) => {
            prop_assert!(f.needed > f.available);
            prop_assert!(f.available <= f.budget.unwrap_or(u64::MAX));
        }
        Err(e) => prop_assert!(false, "unexpected error {}", e),
        Ok(s) => {
            let dec = s.decision;
            match s.mode {
                Mode::Segmented => {
                    prop_assert_eq!(dec.reason, Reason::ExceedsHeadroom);
                    prop_assert!(dec.need() + dec.planning_headroom > dec.available.unwrap());
                    prop_assert!(!c.opts.disable_segmented_compute && m.segments.len() > 1);
                    if c.opts.disable_prefetch {
                        prop_assert_eq!(s.prefetches().count(), 0);
                    }
                }
                Mode::Monolithic => {
                    if dec.reason == Reason::Fits {
                        prop_assert!(dec.need() + dec.planning_headroom <= dec.available.unwrap());
                    }
                    prop_assert_eq!(s.segments.len(), 1);
                }
            }
            // Replay this schedule, then two more runs planned on the resulting state (as
            // sampling steps do); the simulator checks budget, reserve, pins, residency at
            // compute, workspace and cut buffers.
            let mut sim = Simulator::new(d.clone()).with_workspace_owner("m");
            prop_assert_eq!(sim.state_for("m"), d.clone());
            let r = sim.replay(&m, &s, &mut Estimate);
            prop_assert!(r.is_ok(), "{:?}\n{:#?}", r, s);
            for step in 1..3 {
                let r = sim.run(&m, &c.opts, &mut Estimate);
                prop_assert!(r.is_ok(), "step {}: {:?}", step, r);
            }
            if let Some(b) = c.budget {
                // A device that starts above its budget (other runners' bytes) cannot be
                // judged; otherwise the high-water mark stays within it.
                if d.managed() <= b {
                    prop_assert!(sim.high_water() <= b, "{} > {}", sim.high_water(), b);
                }
            }
        }
    }
    Ok(())
}

/// Found by the property in CI: a device that starts 1 byte above its budget (a foreign
/// replica and a reusable buffer) made a prefetch look like it fitted after evictions.
#[test]
fn prefetch_on_a_device_starting_over_its_budget_stays_within_it() {
    let seg = |groups: Vec<u64>, workspace: u64| SegSpec { groups, share_previous: false, workspace, cut: None };
    let mut own = vec![0u8; 40];
    own[0] = 1;
    own[2] = 1;
    own[4] = 1;
    let c = Case {
        segs: vec![
            seg(vec![], 0),
            seg(vec![71483668, 292617868, 844659], 0),
            seg(vec![0], 0),
            seg(vec![195837828, 0], 0),
            seg(vec![105955576], 19107401),
        ],
        budget: Some(391),
        free: None,
        fixed: 0,
        foreign: vec![(96780040, false)],
        own,
        workspace: 23,
        opts: Options::default(),
        async_transfer: false,
    };
    check(c).unwrap();
}
