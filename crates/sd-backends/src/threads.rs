//! CPU thread counts: what `-t` <= 0 means (the number of physical cores, as in the reference).
//!
//! stable-diffusion.cpp sets `n_threads = sd_get_num_physical_cores()` when `-t` is 0 or
//! negative: on Linux the number of distinct `topology/thread_siblings` masks (one per
//! physical core), otherwise the logical CPU count when it is at most 4 and half of it
//! above. (Its Linux probe reads `/sys/devices/system/cpu<N>/...`, a path without the
//! `/cpu` directory level, so there it always falls back to the halved count; we read the
//! real path, which gives the documented meaning.) The count is capped at the CPUs this
//! process may run on (affinity, cgroup quota), so a container limited to 2 CPUs does not
//! start 16 threads.

use std::collections::HashSet;
use std::path::Path;

/// The reference's fallback when the topology is unknown: `n <= 4 ? n : n / 2` of the
/// logical CPUs (`n` = 0 gives 4).
fn fallback_physical_cores(logical: usize) -> usize {
    match logical {
        0 => 4,
        n if n <= 4 => n,
        n => n / 2,
    }
}

/// Physical cores from a sysfs CPU directory (`/sys/devices/system/cpu`): the number of
/// distinct `cpuN/topology/thread_siblings` masks, reading `cpu0`, `cpu1`, ... until one
/// is missing. `None` when there is none.
fn physical_cores_from_sysfs(cpu_dir: &Path) -> Option<usize> {
    let mut siblings = HashSet::new();
    for cpu in 0.. {
        let path = cpu_dir.join(format!("cpu{cpu}")).join("topology/thread_siblings");
        match std::fs::read_to_string(&path) {
            Ok(mask) => {
                siblings.insert(mask.trim().to_string());
            }
            Err(_) => break,
        }
    }
    (!siblings.is_empty()).then_some(siblings.len())
}

/// The number of physical CPU cores (see the module doc), at least 1.
fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let physical =
        if cfg!(target_os = "linux") { physical_cores_from_sysfs(Path::new("/sys/devices/system/cpu")) } else { None }
            .unwrap_or_else(|| fallback_physical_cores(logical));
    let usable = if logical == 0 { physical } else { physical.min(logical) };
    usable.max(1)
}

/// The CPU threads for `-t requested`: the value itself when positive, else [`physical_cores`].
pub fn resolve_threads(requested: i64) -> usize {
    if requested > 0 {
        usize::try_from(requested).unwrap_or(usize::MAX)
    } else {
        physical_cores()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_halves_above_four() {
        let got: Vec<usize> = [0, 1, 2, 4, 5, 8, 16].map(fallback_physical_cores).to_vec();
        assert_eq!(got, [4, 1, 2, 4, 2, 4, 8]);
    }

    #[test]
    fn sysfs_counts_distinct_sibling_masks() {
        let root = std::env::temp_dir().join(format!("sd-backends-cpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(physical_cores_from_sysfs(&root), None);
        // 6 logical CPUs: pairs (0,3) (1,4) (2,5) share a core; cpu7 is past the gap at cpu6.
        for (cpu, mask) in [(0, "09"), (1, "12"), (2, "24"), (3, "09"), (4, "12"), (5, "24"), (7, "80")] {
            let dir = root.join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("thread_siblings"), format!("{mask}\n")).unwrap();
        }
        assert_eq!(physical_cores_from_sysfs(&root), Some(3));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn positive_requests_are_kept_and_the_rest_mean_physical_cores() {
        assert_eq!(resolve_threads(3), 3);
        let physical = physical_cores();
        assert!(physical >= 1);
        assert!(physical <= std::thread::available_parallelism().map(|n| n.get()).unwrap_or(usize::MAX));
        assert_eq!(resolve_threads(0), physical);
        assert_eq!(resolve_threads(-1), physical);
    }
}
