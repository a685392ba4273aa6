//! Segment planning: monolithic or segmented, merging, loads, evictions and prefetch, as plain data.
//!
//! It lives in this pure crate so that the cost model ([`crate::predict`]) replays the very
//! schedules the executor will follow; sd-sched re-exports it as `sd_sched::plan`.
//!
//! # What it is for
//!
//! A module's graph (UNet, text encoder, VAE) carries cut markers at block boundaries, which
//! give it a fixed list of segments in execution order. Before each graph run the executor
//! describes that list and the device's memory to [`plan`] and gets a [`Schedule`]: whether
//! the graph runs whole or in segments, how segments are merged, and for every (merged)
//! segment the exact actions to take — which unpinned replicas to evict and in what order,
//! which parameter groups to load, how large the compute workspace must be, which cut
//! buffers to hold, which groups to prefetch while it computes. The rules are
//! stable-diffusion.cpp's `docs/performance.md` ("Run models that don't fit in VRAM", "Use params backend")
//! and `docs/backend.md` ("Runtime backend vs. parameter backend").
//!
//! # What it refuses to do
//!
//! It uses no ggml or `sd-backends` type: a segment is a name, the parameter groups it needs
//! with their byte counts, the workspace bytes ggml's measure-only allocator reported, and
//! the cut outputs it hands to later segments. It allocates nothing and copies nothing; the
//! executor does, in the order the schedule lists. Bad input (inconsistent sizes, a cut
//! output read before it is written) is a [`PlanError`], never a panic.
//!
//! # Accounting
//!
//! Everything the runtime allocates on the device for models is *managed*: weight replicas,
//! compute workspaces, cut buffers and caches of every runner sharing the device count
//! against one budget (`--max-vram`). Two limits apply at every moment, whichever is
//! tighter:
//!
//! * the explicit managed budget, when there is one: managed bytes never exceed it;
//! * live free memory: allocations never eat into the 512 MiB device scratch reserve
//!   ([`SCRATCH_RESERVE`]).
//!
//! The *capacity* of a run is what this runner could hold at once after reclaiming every
//! unpinned replica (its own and other runners') and its own idle workspace: what remains
//! under the budget after the fixed managed bytes (other runners' workspaces and caches,
//! pinned replicas), and under free memory plus what reclaiming would release, minus the
//! scratch reserve.
//!
//! # The algorithm
//!
//! 1. **Monolithic or segmented.** The graph's *need* is its missing weights (groups with no
//!    replica on the device) plus its incremental workspace (the full graph's workspace
//!    minus the runner's reusable compute buffer: "A reusable monolithic compute buffer is
//!    not counted as a new allocation"). The *available headroom* is, in each of the two
//!    limits, what is left now plus the unpinned replicas that the graph does not use. The
//!    graph runs whole when `need + 128 MiB` ([`PLANNING_HEADROOM`]) fits both. Otherwise,
//!    when it has cut markers (more than one segment) and `--disable-segmented-compute` is
//!    off, it runs its segment list in order. A graph without cuts, an unbounded device
//!    (no budget and no free-memory figure) and `--disable-segmented-compute` run whole;
//!    that fails, naming the device, the bytes needed and the budget, when `need` exceeds
//!    the available headroom (the 128 MiB planning headroom may be consumed, the reserve
//!    and the budget may not).
//! 2. **Merging.** Every single segment must fit the capacity (weights, workspace, the cut
//!    buffers live while it runs), or planning fails naming it. Then, from the first
//!    segment, adjacent segments are merged while the merged segment fits the capacity
//!    less the planning headroom. When prefetch is active, "fits" keeps room for a
//!    neighbour of the same weight to be prefetched next to it, so that transfer overlaps
//!    compute instead of the merged segments filling the device alone. A merged segment's
//!    workspace comes from a [`MergedWorkspace`] (the executor measures the merged graph;
//!    [`Estimate`] is the plain-data approximation).
//! 3. **Actions per segment**, replayed on a model of the device:
//!    reclaim (release an oversized idle workspace first, then evict unpinned replicas:
//!    replicas the graph does not use first, in the order the device lists them, then the
//!    graph's own *from the last segment backward*; the current segment's weights and
//!    groups being prefetched for a later segment are pinned), allocate the workspace,
//!    load the missing groups, allocate the cut buffers it writes (segments that declare
//!    [`CutOutput`]s), then prefetch the next parameter-bearing segment's missing groups
//!    ([`Transfer::Async`] when [`DeviceState::async_transfer`] says the device copies
//!    while it computes, [`Transfer::WorkerThread`] otherwise) only if they fit next to the
//!    current segment after evicting what may be evicted — and only if every segment up to
//!    the target still fits with them pinned — then compute, then release the cut buffers
//!    whose last reader it was. Replicas stay resident after use ("Unpinned replicas
//!    remain resident for reuse"): they are evicted lazily, when an allocation needs the
//!    space. Evicting from the last segment backward keeps a stable run of *leading*
//!    segments resident across repeated runs (sampling steps) whenever the budget leaves
//!    room for them next to the segment being streamed; [`PlannedSegment::stays_resident`]
//!    reports which. A monolithic run evicts only replicas the graph does not use, and
//!    only as many as it needs, before it allocates.
//!
//! The executor plans before every graph run with the live device state (free memory can
//! drop between runs). Because reclaimable replicas count as available, the choice equals
//! "the whole graph's weights and workspace plus 128 MiB fit the capacity" whatever is
//! resident (an oversized reusable buffer aside): "later graph runs remain segmented when
//! the full graph exceeds the budget", even once all its weights happen to be resident (such
//! runs transfer nothing).
//!
//! # What the executor asks of it
//!
//! The planner's vocabulary is wider than what sd-sched's `Runner` (the executor, which re-exports this module as
//! `sd_sched::plan`) uses today: the runner
//! declares no [`CutOutput`]s (its cut tensors and graph inputs share one buffer for the
//! whole run, passed as [`DeviceState::fixed`]), so its schedules contain no
//! [`Action::AllocCut`]/[`Action::ReleaseCut`]; it sets [`DeviceState::async_transfer`] to
//! false, so its prefetches are [`Transfer::WorkerThread`], copied while the segment that
//! issues them computes and finished before the next segment starts. It refuses a
//! schedule asking for either before running anything. Cut outputs and asynchronous
//! transfer are planned and simulated here (and tested) for executors that offer them.
//!
//! The [`Simulator`] replays schedules on an independent ledger, checks every action (an
//! eviction of a pinned replica, a load that does not fit, a segment computing without its
//! weights, managed bytes above the budget, free memory below the reserve) and reports the
//! managed high-water mark and the bytes transferred per run. The executor's own accounting
//! must satisfy the same checks.
//!
//! # Use
//!
//! ```
//! use sd_placement::segments::{plan, Action, DeviceState, Estimate, Mode, ModuleGraph, Options, ParamGroup,
//!                      Segment, Simulator, MIB};
//!
//! // Eight 100 MiB blocks with 50 MiB of workspace each, on a device with a 600 MiB budget.
//! let segments = (0..8)
//!     .map(|i| Segment::new(format!("block.{i}"), vec![ParamGroup::new(format!("unet/block.{i}"), 100 * MIB)], 50 * MIB))
//!     .collect();
//! let unet = ModuleGraph { name: "unet".into(), segments };
//! let device = DeviceState::new("CUDA0", Some(600 * MIB), None);
//! let schedule = plan(&unet, &device, &Options::default(), &mut Estimate).unwrap();
//! assert_eq!(schedule.mode, Mode::Segmented);
//! // An executor performs each segment's actions in order: evictions, workspace, loads, cut
//! // buffers, prefetches (issued before computing, awaited at the latest by the segment that
//! // needs them), compute, cut-buffer releases.
//! assert!(matches!(schedule.segments[0].actions.last(), Some(Action::Compute)));
//! // Four sampling steps on a simulated device: the budget holds, and the steps after the first
//! // copy less because the leading blocks stay resident.
//! let mut sim = Simulator::new(device);
//! let copied: Vec<u64> = (0..4)
//!     .map(|_| sim.run(&unet, &Options::default(), &mut Estimate).unwrap().1.transferred())
//!     .collect();
//! assert!(sim.high_water() <= 600 * MIB);
//! assert!(copied[1] < copied[0]);
//! ```
//!
//! Group names are global on a device: callers qualify them (`diffusion/input_blocks.1`) so
//! that replicas of different modules never collide.

mod error;
mod model;
mod planner;
mod schedule;
mod sim;
mod workspace;

pub use error::{PlanError, Shortfall};
pub use model::{CutOutput, DeviceState, ModuleGraph, Options, ParamGroup, Replica, Segment};
pub use planner::plan;
pub use schedule::{Action, Decision, Mode, PlannedSegment, Reason, Schedule, Transfer};
pub use sim::{RunReport, SimError, Simulator, Violation};
pub use workspace::{Estimate, MergedWorkspace};

/// One MiB.
pub const MIB: u64 = 1 << 20;

/// Free device memory that allocations never use (`performance.md`: "the 512 MiB device
/// scratch reserve").
pub const SCRATCH_RESERVE: u64 = 512 * MIB;

/// Extra headroom required to choose monolithic execution, in both free memory and the
/// managed budget (`performance.md`: "an additional 128 MiB of headroom").
pub const PLANNING_HEADROOM: u64 = 128 * MIB;
