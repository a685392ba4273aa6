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
//! sees them ([`crate::plan::DeviceState::replicas`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Result, SchedError};
use crate::plan::Replica;

#[derive(Debug, Default)]
struct State {
    managed: u64,
    high_water: u64,
    replicas: Vec<Replica>,
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

    /// Resident replicas, oldest first.
    pub fn replicas(&self) -> Vec<Replica> {
        self.lock().replicas.clone()
    }

    /// Records `bytes` about to be allocated for `what`; fails, charging nothing, when that
    /// would exceed the budget.
    pub fn charge(&self, bytes: u64, what: &str) -> Result<()> {
        let mut s = self.lock();
        let after = s.managed.saturating_add(bytes);
        if let Some(budget) = self.budget {
            if after > budget {
                return Err(SchedError::OverBudget {
                    device: self.device.clone(),
                    bytes,
                    what: what.to_string(),
                    managed: s.managed,
                    budget,
                });
            }
        }
        s.managed = after;
        s.high_water = s.high_water.max(after);
        Ok(())
    }

    /// Records `bytes` freed.
    pub fn credit(&self, bytes: u64) {
        let mut s = self.lock();
        s.managed = s.managed.saturating_sub(bytes);
    }

    /// Charges a replica of `group` and lists it.
    pub fn add_replica(&self, group: &str, bytes: u64, pinned: bool) -> Result<()> {
        self.charge(bytes, &format!("the weights of {group}"))?;
        self.lock().replicas.push(Replica { group: group.to_string(), bytes, pinned });
        Ok(())
    }

    /// Credits and unlists the replica of `group` (no-op when not listed).
    pub fn remove_replica(&self, group: &str) {
        let mut s = self.lock();
        if let Some(i) = s.replicas.iter().position(|r| r.group == group) {
            let r = s.replicas.remove(i);
            s.managed = s.managed.saturating_sub(r.bytes);
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
