//! Managed-memory accounting per device: one ledger per device, shared by every runner on it.
//!
//! Everything the runtime allocates on a device for models is *managed*: weight replicas,
//! compute buffers and cut buffers of every runner that shares the device count against one
//! budget (`--max-vram`). A [`Ledger`] is charged before each allocation (so an allocation
//! that would exceed the budget fails with the device, the bytes and the budget, and nothing
//! is allocated) and credited when the allocation is freed. It records the high-water mark,
//! which tests assert never exceeds the budget.
//!
//! The ledger also lists the weight replicas resident on the device, so the segment planner
//! sees them ([`crate::plan::DeviceState::replicas`]), least recently used first.
//!
//! Eviction under pressure (stable-diffusion.cpp's `docs/performance.md`: unpinned replicas
//! are evicted "when the next weight or compute allocation needs space"): a staged replica is
//! listed with the weight set that can free it ([`Owner`]). A charge that would exceed the
//! budget first evicts *evictable* replicas, least recently used first, exactly as many as it
//! needs, and only then charges; when even evicting all of them would not make room it evicts
//! nothing and fails with the usual message. Evictable means: unpinned, of any weight set on
//! the device, and not *held*. A runner holds the groups its current segment (or graph) reads
//! and those it is prefetching ([`crate::Weights`]' `set_in_use`); a replica is held from its
//! allocation until its set's next `set_in_use`, so a fresh one is never taken before it is
//! filled and used. Holding a group also marks it used (moves it to the back of the list).
//! An evicted replica's tensors are re-staged by their set before any graph reads them again
//! (the runner checks every group a segment reads before it computes), so eviction changes
//! where weights live, never what a graph computes. The ledger counts what it evicted
//! ([`Ledger::evictions`], [`Ledger::evicted_bytes`]) for the run report.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::{Result, SchedError};
use crate::plan::Replica;

/// Frees replicas on the ledger's behalf: a placed weight set's replica slots.
pub(crate) trait Evict: Send + Sync {
    /// Frees the replica in `slot` unless it is already gone; whether it freed it. Called
    /// with the ledger locked: it must not call the ledger.
    fn evict(&self, slot: usize) -> bool;
}

/// The weight set a listed replica belongs to, which can free it.
#[derive(Clone)]
pub(crate) struct Owner {
    /// The set's placement (unique in the process).
    pub(crate) id: u64,
    /// The group's index in the set.
    pub(crate) slot: usize,
    /// The set's replica slots.
    pub(crate) evictor: Weak<dyn Evict>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Owner(set {}, group {})", self.id, self.slot)
    }
}

/// A listed replica.
#[derive(Debug)]
struct Entry {
    replica: Replica,
    /// Who can free it; `None`: the ledger never evicts it.
    owner: Option<Owner>,
    /// In use by a running graph, or allocated and not yet released by its set.
    held: bool,
}

impl Entry {
    fn evictable(&self) -> bool {
        !self.replica.pinned && !self.held && self.owner.is_some()
    }
}

#[derive(Debug, Default)]
struct State {
    managed: u64,
    high_water: u64,
    /// Least recently used first.
    entries: Vec<Entry>,
    evictions: usize,
    evicted_bytes: u64,
}

/// The managed-memory account of one device (cheap to clone; clones share the account).
#[derive(Clone, Debug)]
pub struct Ledger {
    device: String,
    budget: Option<u64>,
    state: Arc<Mutex<State>>,
}

impl Ledger {
    /// An account for `device` with an optional budget in bytes.
    pub fn new(device: impl Into<String>, budget: Option<u64>) -> Self {
        Self { device: device.into(), budget, state: Arc::default() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Managed bytes now.
    pub fn managed(&self) -> u64 {
        self.lock().managed
    }

    /// The most managed bytes at any moment.
    pub fn high_water(&self) -> u64 {
        self.lock().high_water
    }

    /// Replicas the ledger evicted to make room for another allocation (module docs).
    pub fn evictions(&self) -> usize {
        self.lock().evictions
    }

    /// Bytes of those replicas.
    pub fn evicted_bytes(&self) -> u64 {
        self.lock().evicted_bytes
    }

    /// Resident replicas, least recently used first; a held one (in use by a running graph)
    /// is listed as pinned, since nothing may evict it.
    pub fn replicas(&self) -> Vec<Replica> {
        self.lock()
            .entries
            .iter()
            .map(|e| Replica { pinned: e.replica.pinned || e.held, ..e.replica.clone() })
            .collect()
    }

    /// Records `bytes` about to be allocated for `what`, evicting evictable replicas first
    /// when the budget needs the room (module docs); fails, charging and evicting nothing,
    /// when even evicting all of them would not make room.
    pub fn charge(&self, bytes: u64, what: &str) -> Result<()> {
        let mut s = self.lock();
        self.make_room(&mut s, bytes, what)?;
        s.managed = s.managed.saturating_add(bytes);
        s.high_water = s.high_water.max(s.managed);
        Ok(())
    }

    /// Evicts, least recently used first, until `bytes` more fit the budget.
    fn make_room(&self, s: &mut State, bytes: u64, what: &str) -> Result<()> {
        let Some(budget) = self.budget else { return Ok(()) };
        let over = |s: &State| s.managed.saturating_add(bytes) > budget;
        let refuse = |s: &State| SchedError::OverBudget {
            device: self.device.clone(),
            bytes,
            what: what.to_string(),
            managed: s.managed,
            budget,
        };
        if !over(s) {
            return Ok(());
        }
        let evictable =
            s.entries.iter().filter(|e| e.evictable()).map(|e| e.replica.bytes).fold(0, u64::saturating_add);
        if s.managed.saturating_sub(evictable).saturating_add(bytes) > budget {
            return Err(refuse(s));
        }
        let mut i = 0;
        while over(s) && i < s.entries.len() {
            if !(s.entries[i].evictable() && self.evict_at(s, i)) {
                i += 1;
            }
        }
        if over(s) {
            // Only when a set freed a replica itself meanwhile (its credit is on the way).
            return Err(refuse(s));
        }
        Ok(())
    }

    /// Has the owner free entry `i` and unlists it; whether it was freed.
    fn evict_at(&self, s: &mut State, i: usize) -> bool {
        let Some(owner) = s.entries[i].owner.clone() else { return false };
        let Some(evictor) = owner.evictor.upgrade() else { return false };
        if !evictor.evict(owner.slot) {
            return false;
        }
        let e = s.entries.remove(i);
        s.managed = s.managed.saturating_sub(e.replica.bytes);
        s.evictions += 1;
        s.evicted_bytes = s.evicted_bytes.saturating_add(e.replica.bytes);
        tracing::debug!("{}: evicted {} ({} bytes) to make room", self.device, e.replica.group, e.replica.bytes);
        true
    }

    /// Evicts the replica of `group` if it is evictable (module docs); whether it did.
    pub(crate) fn evict(&self, group: &str) -> bool {
        let mut s = self.lock();
        match s.entries.iter().position(|e| e.replica.group == group) {
            Some(i) if s.entries[i].evictable() => self.evict_at(&mut s, i),
            _ => false,
        }
    }

    /// Records `bytes` freed.
    pub fn credit(&self, bytes: u64) {
        let mut s = self.lock();
        s.managed = s.managed.saturating_sub(bytes);
    }

    /// Charges a replica of `group` and lists it; the ledger never evicts it (pinned, or
    /// with no owner to free it).
    pub fn add_replica(&self, group: &str, bytes: u64, pinned: bool) -> Result<()> {
        self.add_entry(group, bytes, pinned, None)
    }

    /// Charges a staged replica of `group` that `owner` can free, and lists it held (module
    /// docs).
    pub(crate) fn add_evictable(&self, group: &str, bytes: u64, owner: Owner) -> Result<()> {
        self.add_entry(group, bytes, false, Some(owner))
    }

    fn add_entry(&self, group: &str, bytes: u64, pinned: bool, owner: Option<Owner>) -> Result<()> {
        let mut s = self.lock();
        let what = format!("the weights of {group}");
        self.make_room(&mut s, bytes, &what)?;
        s.managed = s.managed.saturating_add(bytes);
        s.high_water = s.high_water.max(s.managed);
        let held = owner.is_some();
        s.entries.push(Entry { replica: Replica { group: group.to_string(), bytes, pinned }, owner, held });
        Ok(())
    }

    /// Holds exactly the replicas of set `id` whose slot `held` selects, and marks them used
    /// (moved to the back of the list, in their order).
    pub(crate) fn hold_only(&self, id: u64, held: &dyn Fn(usize) -> bool) {
        let mut s = self.lock();
        let mut any = false;
        for e in &mut s.entries {
            if let Some(o) = e.owner.as_ref().filter(|o| o.id == id) {
                e.held = held(o.slot);
                any |= e.held;
            }
        }
        if any {
            let (mut rest, used): (Vec<Entry>, Vec<Entry>) =
                s.entries.drain(..).partition(|e| !(e.held && e.owner.as_ref().is_some_and(|o| o.id == id)));
            rest.extend(used);
            s.entries = rest;
        }
    }

    /// Credits and unlists the replica of `group` (no-op when not listed).
    pub fn remove_replica(&self, group: &str) {
        let mut s = self.lock();
        if let Some(i) = s.entries.iter().position(|e| e.replica.group == group) {
            let e = s.entries.remove(i);
            s.managed = s.managed.saturating_sub(e.replica.bytes);
        }
    }
}

/// One ledger per device name, with the budgets `--max-vram` gives.
#[derive(Clone, Debug, Default)]
pub struct Ledgers {
    budgets: HashMap<String, u64>,
    ledgers: Arc<Mutex<HashMap<String, Ledger>>>,
}

impl Ledgers {
    /// Ledgers with explicit budgets per device name (devices not listed are unbounded).
    pub fn with_budgets(budgets: HashMap<String, u64>) -> Self {
        Self { budgets, ledgers: Arc::default() }
    }

    /// The ledger of `device` (created on first use).
    pub fn get(&self, device: &str) -> Ledger {
        let mut map = self.ledgers.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(device.to_string()).or_insert_with(|| Ledger::new(device, self.budgets.get(device).copied())).clone()
    }

    /// Every ledger created so far, by device name.
    pub fn all(&self) -> Vec<Ledger> {
        let map = self.ledgers.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<Ledger> = map.values().cloned().collect();
        v.sort_by(|a, b| a.device.cmp(&b.device));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_within_the_budget_and_refuses_beyond_it() {
        let l = Ledger::new("RPC0", Some(100));
        l.charge(60, "a").unwrap();
        let err = l.charge(50, "the unet compute buffer").unwrap_err().to_string();
        assert!(err.contains("RPC0") && err.contains("50") && err.contains("100"), "{err}");
        assert_eq!(l.managed(), 60, "a refused charge changes nothing");
        l.credit(60);
        l.charge(100, "b").unwrap();
        assert_eq!(l.high_water(), 100);
    }

    #[test]
    fn replicas_are_listed_and_credited() {
        let l = Ledger::new("CPU", None);
        l.add_replica("unet/a", 10, false).unwrap();
        l.add_replica("unet/b", 20, true).unwrap();
        assert_eq!(l.managed(), 30);
        l.remove_replica("unet/a");
        assert_eq!(l.managed(), 20);
        assert_eq!(l.replicas().len(), 1);
        assert_eq!(l.high_water(), 30);
    }

    #[test]
    fn ledgers_share_one_account_per_device() {
        let all = Ledgers::with_budgets(HashMap::from([("RPC0".to_string(), 5)]));
        all.get("RPC0").charge(3, "x").unwrap();
        assert_eq!(all.get("RPC0").managed(), 3);
        assert!(all.get("RPC0").charge(3, "y").is_err());
        assert_eq!(all.get("CPU").budget(), None);
    }
}

/// Eviction under pressure with real weight sets on the CPU device: the order, the amount,
/// and what is never evicted.
#[cfg(test)]
mod eviction_tests {
    use std::borrow::Cow;

    use proptest::prelude::*;
    use sd_backends::{Backend, GgmlType};

    use super::*;
    use crate::weights::{GroupId, ParamHome, SourceError, TensorSource, TensorSpec, Weights};

    const N: i64 = 16;
    const WHAT: &str = "a test allocation";

    /// Each tensor's values follow from its name.
    struct ByName;

    fn values(name: &str) -> Vec<f32> {
        let seed = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
        (0..N * N)
            .map(|i| ((seed.wrapping_add((i as u32).wrapping_mul(2654435761)) >> 16) % 1000) as f32 / 1000.0)
            .collect()
    }

    impl TensorSource for ByName {
        fn load(&self, name: &str, _: GgmlType, _: &[i64]) -> std::result::Result<Cow<'_, [u8]>, SourceError> {
            Ok(Cow::Owned(values(name).iter().flat_map(|v| v.to_le_bytes()).collect()))
        }
    }

    fn cpu() -> Arc<Backend> {
        crate::test_cpu()
    }

    fn dev() -> String {
        cpu().device().name()
    }

    /// Set `module` of `n` groups (`module/g0`, ...) of one N×N f32 tensor each, at `home`.
    fn set(module: &str, n: usize, home: ParamHome, ledgers: &Ledgers) -> Weights {
        let specs = (0..n)
            .map(|i| TensorSpec { name: format!("g{i}.w"), ty: GgmlType::GGML_TYPE_F32, ne: vec![N, N] })
            .collect();
        let mut w = Weights::new(specs).unwrap();
        let group_of = |name: &str| name[..name.len() - 2].to_string();
        w.place(module, home, cpu(), ledgers, &group_of, Arc::new(ByName)).unwrap();
        w
    }

    fn stage(w: &Weights, g: usize) -> Result<()> {
        w.alloc_group(GroupId(g))?;
        w.fill_group(GroupId(g))
    }

    fn resident(l: &Ledger) -> Vec<String> {
        l.replicas().into_iter().map(|r| r.group).collect()
    }

    #[test]
    fn a_charge_evicts_idle_replicas_least_recently_used_first_exactly_as_many_as_it_needs() {
        let probe = set("probe", 1, ParamHome::Host, &Ledgers::default());
        let b = probe.group_bytes(GroupId(0));
        let ledgers = Ledgers::with_budgets(HashMap::from([(dev(), 6 * b)]));
        let l = ledgers.get(&dev());
        let pinned = set("p", 1, ParamHome::Compute, &ledgers);
        let (a, o) = (set("a", 3, ParamHome::Host, &ledgers), set("o", 1, ParamHome::Host, &ledgers));
        for (w, g) in [(&a, 0), (&a, 1), (&o, 0), (&a, 2)] {
            stage(w, g).unwrap();
        }
        a.set_in_use(&[]);
        o.set_in_use(&[]);
        assert_eq!(l.managed(), 5 * b);
        // a/g1 is in use by a running graph: held, and now the most recently used.
        a.set_in_use(&[GroupId(1)]);
        assert_eq!(resident(&l), ["p/g0", "a/g0", "o/g0", "a/g2", "a/g1"]);
        assert!(l.replicas()[4].pinned, "a held replica is shown to the planner as pinned");

        // 2b + 1 more: the two least recently used idle replicas go (one is not enough).
        l.charge(2 * b + 1, WHAT).unwrap();
        assert_eq!(resident(&l), ["p/g0", "a/g2", "a/g1"]);
        assert_eq!((l.evictions(), l.evicted_bytes()), (2, 2 * b));
        assert!(!a.is_resident(GroupId(0)) && !o.is_resident(GroupId(0)) && a.is_resident(GroupId(2)));
        assert_eq!(l.managed(), 5 * b + 1);

        // What evicting every idle replica could not make room for evicts nothing.
        let err = l.charge(2 * b, "the te cut buffers").unwrap_err().to_string();
        assert!(
            err.contains(&dev()) && err.contains("the te cut buffers") && err.contains(&(6 * b).to_string()),
            "{err}"
        );
        assert_eq!((resident(&l).len(), l.evictions(), l.managed()), (3, 2, 5 * b + 1));

        // Released, the held replica is evictable, but after the older idle one.
        a.set_in_use(&[]);
        l.charge(b, WHAT).unwrap();
        assert_eq!(resident(&l), ["p/g0", "a/g1"]);
        assert_eq!((l.evictions(), l.managed(), l.high_water()), (3, 5 * b + 1, 5 * b + 1));

        // An evicted group is staged again with its own bytes.
        l.credit(3 * b + 1);
        stage(&a, 0).unwrap();
        assert_eq!(a.get("g0.w").unwrap().get_f32().unwrap(), values("g0.w"));
        drop((a, o, pinned));
        assert_eq!(l.managed(), 0, "everything released");
    }

    #[test]
    fn staging_under_pressure_evicts_another_set_and_never_a_fresh_replica() {
        let probe = set("probe", 1, ParamHome::Host, &Ledgers::default());
        let b = probe.group_bytes(GroupId(0));
        let ledgers = Ledgers::with_budgets(HashMap::from([(dev(), 2 * b)]));
        let l = ledgers.get(&dev());
        let (a, o) = (set("a", 2, ParamHome::Host, &ledgers), set("o", 1, ParamHome::Host, &ledgers));
        stage(&o, 0).unwrap();
        o.set_in_use(&[]);
        stage(&a, 0).unwrap();
        // a/g0 was just allocated and not released by its set: a/g1 takes o's place, not its.
        stage(&a, 1).unwrap();
        assert_eq!(resident(&l), ["a/g0", "a/g1"]);
        assert!(!o.is_resident(GroupId(0)));
        // With every replica held, nothing can make room.
        let err = stage(&o, 0).unwrap_err();
        assert!(matches!(err, SchedError::OverBudget { .. }), "{err}");
        assert_eq!((l.managed(), l.evictions()), (2 * b, 1));
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Stage group `.1` of set `.0`.
        Stage(usize, usize),
        /// Hold the groups of set `.0` whose bit is set in `.1` (release the others).
        Hold(usize, u8),
        /// Charge this many bytes (in eighths of a group).
        Charge(u64),
        /// Credit everything charged so far.
        CreditAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..2usize, 0..3usize).prop_map(|(s, g)| Op::Stage(s, g)),
            (0..2usize, any::<u8>()).prop_map(|(s, m)| Op::Hold(s, m)),
            (1..24u64).prop_map(Op::Charge),
            Just(Op::CreditAll),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Whatever the sequence: managed bytes never exceed the budget; a held or pinned
        /// replica is never evicted; a refused allocation evicts nothing; an accepted one
        /// evicts the shortest run of idle replicas, least recently used first, that makes
        /// room.
        #[test]
        fn eviction_is_minimal_in_lru_order_and_spares_held_and_pinned(
            budget_groups in 2..7u64,
            ops in proptest::collection::vec(op(), 1..40),
        ) {
            let probe = set("probe", 1, ParamHome::Host, &Ledgers::default());
            let b = probe.group_bytes(GroupId(0));
            let budget = budget_groups * b;
            let ledgers = Ledgers::with_budgets(HashMap::from([(dev(), budget)]));
            let l = ledgers.get(&dev());
            let _pinned = set("p", 1, ParamHome::Compute, &ledgers);
            let sets = [set("a", 3, ParamHome::Host, &ledgers), set("o", 3, ParamHome::Host, &ledgers)];
            let mut charged = 0u64;
            for op in ops {
                let before = l.replicas();
                let managed = l.managed();
                let (bytes, added) = match op {
                    Op::Stage(s, g) if !sets[s].is_resident(GroupId(g)) => (b, Some(format!("{}/g{g}", ["a", "o"][s]))),
                    Op::Charge(eighths) => (eighths * b / 8, None),
                    Op::Stage(..) => (0, None),
                    Op::Hold(s, mask) => {
                        let held: Vec<GroupId> = (0..3).filter(|g| mask & (1 << g) != 0).map(GroupId).collect();
                        sets[s].set_in_use(&held);
                        (0, None)
                    }
                    Op::CreditAll => {
                        l.credit(charged);
                        charged = 0;
                        (0, None)
                    }
                };
                let ok = match op {
                    Op::Stage(s, g) => stage(&sets[s], g).is_ok(),
                    Op::Charge(_) => l.charge(bytes, WHAT).is_ok(),
                    _ => true,
                };
                if ok && matches!(op, Op::Charge(_)) {
                    charged += bytes;
                }
                let after: Vec<String> = resident(&l);
                let evicted: Vec<String> =
                    before.iter().map(|r| r.group.clone()).filter(|g| !after.contains(g)).collect();
                prop_assert!(l.managed() <= budget && l.high_water() <= budget);
                // The model: the shortest prefix of idle replicas, in list order, making room.
                let mut expect = Vec::new();
                let mut freed = 0;
                for r in before.iter().filter(|r| !r.pinned) {
                    if managed + bytes <= budget + freed {
                        break;
                    }
                    freed += r.bytes;
                    expect.push(r.group.clone());
                }
                if managed + bytes > budget + freed {
                    prop_assert!(!ok, "{op:?} fit only by evicting pinned or held replicas");
                    prop_assert!(evicted.is_empty(), "{op:?} was refused but evicted {evicted:?}");
                } else {
                    prop_assert!(ok, "{op:?} was refused: {before:?}");
                    prop_assert_eq!(&evicted, &expect, "{:?}", op);
                    if let Some(g) = added {
                        prop_assert_eq!(after.last(), Some(&g));
                    }
                }
            }
        }
    }
}
