//! The plugin registry: finds backend modules, loads the usable ones, records why others were skipped.
//!
//! Search order (first directory that has a backend wins for that backend):
//! 1. directories given explicitly (`--plugin-dir`),
//! 2. beside the running executable: its own directory (ggml's convention for dynamic
//!    backends), then `<its directory>/../lib/sd-rs/plugins` ([`INSTALL_PLUGIN_DIR`], where
//!    `cargo xtask install` and `cargo xtask dist` put them),
//! 3. `SD_PLUGIN_PATH` (a `:`-separated list; `;` on Windows),
//! 4. the build tree's plugin directory, fixed at build time ([`ggml_sys::BUILD_PLUGIN_DIR`]).
//!
//! So an installed or unpacked `sd-cli` uses its own plugins wherever it is moved, and a
//! plugin built later (`cargo xtask plugins --backend vulkan --out DIR`) dropped into that
//! directory is picked up.
//!
//! The current working directory is never searched. A plugin file is
//! `libggml-<backend>[-<variant>].so` (`ggml-<backend>[-<variant>].dll` on Windows; ggml's
//! convention, [`ggml_sys::names`]); among the variants of one backend in one
//! directory the highest `ggml_backend_score` wins (0 = unusable on this CPU).
//! Loading follows the contract of ggml's dynamic backends: dlopen, score, call
//! `ggml_backend_init`, check the registration's `api_version`, keep it. Loaded
//! plugins are never unloaded (their library handle is leaked on purpose: ggml
//! objects they created may outlive any owner we could name).

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt;
use std::path::{Path, PathBuf};

use ggml_sys as sys;
use libloading::Library;
use serde::Serialize;

use crate::device::Device;
use crate::error::{BackendError, Result};
use crate::rpc;

/// The plugin directory of an installation, relative to its prefix, the parent of the
/// executable's directory (`PREFIX/bin/sd-cli` -> `PREFIX/lib/sd-rs/plugins`); the core
/// library lies in `PREFIX/lib`, which the executable's run path (`$ORIGIN/../lib`) names.
pub const INSTALL_PLUGIN_DIR: &str = "lib/sd-rs/plugins";

/// Where to look for plugins, in priority order.
#[derive(Clone, Debug, Default)]
pub struct PluginSearch {
    /// Explicit directories (`--plugin-dir`), searched first.
    pub explicit: Vec<PathBuf>,
    /// Also search `SD_PLUGIN_PATH`.
    pub use_env: bool,
    /// Also search the executable's directory.
    pub use_exe_dir: bool,
    /// Also search the build tree's plugin directory.
    pub use_install_dir: bool,
}

impl PluginSearch {
    /// The standard order: explicit dirs, the executable's directory and the installed
    /// plugin directory beside it, `SD_PLUGIN_PATH`, the build tree.
    pub fn standard(explicit: Vec<PathBuf>) -> Self {
        Self { explicit, use_env: true, use_exe_dir: true, use_install_dir: true }
    }

    /// Only the given directories (tests, embedding programs).
    pub fn only(dirs: Vec<PathBuf>) -> Self {
        Self { explicit: dirs, use_env: false, use_exe_dir: false, use_install_dir: false }
    }

    /// The directories this search visits, in order, with where each came from.
    pub fn directories(&self) -> Vec<(PathBuf, &'static str)> {
        let mut dirs: Vec<(PathBuf, &'static str)> =
            self.explicit.iter().map(|d| (d.clone(), "--plugin-dir")).collect();
        if self.use_exe_dir {
            if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
                let installed = dir.parent().map(|prefix| prefix.join(INSTALL_PLUGIN_DIR));
                dirs.push((dir, "executable directory"));
                dirs.extend(installed.map(|d| (d, "installed beside the executable")));
            }
        }
        if self.use_env {
            if let Some(v) = std::env::var_os("SD_PLUGIN_PATH") {
                dirs.extend(
                    std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).map(|p| (p, "SD_PLUGIN_PATH")),
                );
            }
        }
        if self.use_install_dir {
            dirs.push((PathBuf::from(sys::BUILD_PLUGIN_DIR), "build tree"));
        }
        // A relative path would resolve against the working directory: make it
        // absolute now so that the meaning is fixed and visible in logs.
        let cwd = std::env::current_dir().ok();
        let mut seen = Vec::new();
        dirs.into_iter()
            .map(|(d, o)| match (&cwd, d.is_relative()) {
                (Some(c), true) => (c.join(d), o),
                _ => (d, o),
            })
            .filter(|(d, _)| {
                let key = d.canonicalize().unwrap_or_else(|_| d.clone());
                let new = !seen.contains(&key);
                seen.push(key);
                new
            })
            .collect()
    }
}

/// Why a plugin file was not used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SkipReason {
    /// The file is not a loadable shared library.
    NotAPlugin { detail: String },
    /// A library it depends on could not be found.
    MissingDependency { detail: String },
    /// It is a shared library without `ggml_backend_init`.
    NoInitSymbol,
    /// Its registration reports another backend API version.
    ApiVersionMismatch { found: i32, expected: i32 },
    /// Its score function says this CPU cannot run it.
    UnusableOnThisCpu,
    /// `ggml_backend_init` returned no registration.
    InitFailed,
    /// Another variant of the same backend scored higher.
    Superseded { by: PathBuf, score: i32, winner_score: i32 },
    /// The same backend was already loaded from an earlier directory.
    Shadowed { by: PathBuf },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAPlugin { detail } => write!(f, "not a ggml plugin: {detail}"),
            Self::MissingDependency { detail } => write!(f, "a library it needs is missing: {detail}"),
            Self::NoInitSymbol => write!(f, "not a ggml plugin: no `ggml_backend_init` symbol"),
            Self::ApiVersionMismatch { found, expected } => write!(
                f,
                "backend API version mismatch: the plugin reports {found}, this build of ggml expects {expected}"
            ),
            Self::UnusableOnThisCpu => write!(f, "unusable on this CPU (score 0)"),
            Self::InitFailed => write!(
                f,
                "`ggml_backend_init` returned no registration (the backend could not start: a GPU plugin whose \
                 driver is missing or failed, e.g. no Vulkan driver for the Vulkan plugin)"
            ),
            Self::Superseded { by, score, winner_score } => {
                write!(f, "variant with score {score} superseded by {} (score {winner_score})", by.display())
            }
            Self::Shadowed { by } => write!(f, "shadowed by {} (searched earlier)", by.display()),
        }
    }
}

/// A plugin file that was not used, and why.
#[derive(Clone, Debug, Serialize)]
pub struct SkippedPlugin {
    /// The file.
    pub path: PathBuf,
    /// Why it was skipped.
    pub reason: SkipReason,
}

/// A backend registration that is in use.
#[derive(Clone, Debug, Serialize)]
pub struct LoadedPlugin {
    /// The registration's name (`CPU`, `RPC[127.0.0.1:50052]`, ...).
    pub name: String,
    /// The file it came from.
    pub path: PathBuf,
    /// Its score, if it exports one.
    pub score: Option<i32>,
    /// For RPC registrations, the server endpoint.
    pub endpoint: Option<String>,
    #[serde(skip)]
    pub(crate) reg: RegHandle,
}

/// A `ggml_backend_reg_t` of a plugin that is never unloaded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegHandle(pub(crate) sys::ggml_backend_reg_t);
// SAFETY: registrations are immutable, process-lifetime objects; ggml's reg API
// may be called from any thread.
unsafe impl Send for RegHandle {}
// SAFETY: as above.
unsafe impl Sync for RegHandle {}

impl RegHandle {
    pub(crate) fn name(self) -> String {
        // SAFETY: a live registration returns a static NUL-terminated name.
        unsafe { cstr(sys::ggml_backend_reg_name(self.0)) }
    }

    pub(crate) fn proc(self, symbol: &CStr) -> Option<*mut std::os::raw::c_void> {
        // SAFETY: a live registration; the name is NUL-terminated.
        let p = unsafe { sys::ggml_backend_reg_get_proc_address(self.0, symbol.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    pub(crate) fn devices(self) -> Vec<Device> {
        // SAFETY: a live registration; indices below the count are valid.
        let n = unsafe { sys::ggml_backend_reg_dev_count(self.0) };
        (0..n)
            .filter_map(|i| {
                // SAFETY: as above.
                let d = unsafe { sys::ggml_backend_reg_dev_get(self.0, i) };
                Device::from_raw(d)
            })
            .collect()
    }
}

pub(crate) unsafe fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string or null.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// The loaded plugins, the skipped files and the devices they provide.
#[derive(Debug)]
pub struct PluginRegistry {
    searched: Vec<(PathBuf, &'static str)>,
    plugins: Vec<LoadedPlugin>,
    skipped: Vec<SkippedPlugin>,
}

/// A candidate plugin file, grouped by backend name.
struct Candidate {
    path: PathBuf,
    lib: Library,
    score: Option<i32>,
}

impl PluginRegistry {
    /// Searches the directories and loads every usable plugin. Never fails:
    /// unusable files are recorded in [`PluginRegistry::skipped`].
    pub fn discover(search: &PluginSearch) -> Self {
        crate::log::install_log_bridge();
        let searched = search.directories();
        let mut reg = Self { searched: searched.clone(), plugins: Vec::new(), skipped: Vec::new() };
        // backend name -> path it was loaded from
        let mut taken: BTreeMap<String, PathBuf> = BTreeMap::new();
        for (dir, origin) in &searched {
            tracing::debug!(dir = %dir.display(), origin, "searching for plugins");
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            let mut groups: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
            let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            files.sort();
            for path in files {
                if let Some(backend) = backend_name_of(&path) {
                    groups.entry(backend).or_default().push(path);
                }
            }
            for (backend, paths) in groups {
                if let Some(by) = taken.get(&backend) {
                    for path in paths {
                        reg.skip(path, SkipReason::Shadowed { by: by.clone() });
                    }
                    continue;
                }
                if let Some(path) = reg.load_best(paths) {
                    taken.insert(backend, path);
                }
            }
        }
        reg
    }

    fn skip(&mut self, path: PathBuf, reason: SkipReason) {
        match reason {
            // Choosing the best CPU variant is normal operation, not news.
            SkipReason::Superseded { .. } | SkipReason::Shadowed { .. } => {
                tracing::debug!(plugin = %path.display(), "not using plugin: {reason}")
            }
            _ => tracing::info!(plugin = %path.display(), "skipping plugin: {reason}"),
        }
        self.skipped.push(SkippedPlugin { path, reason });
    }

    /// Loads the variants of one backend, keeps the best usable one.
    fn load_best(&mut self, paths: Vec<PathBuf>) -> Option<PathBuf> {
        let mut candidates = Vec::new();
        for path in paths {
            match open_library(&path) {
                Ok(lib) => {
                    // SAFETY: the symbol, when present, has ggml's score signature.
                    let score = unsafe { lib.get::<sys::BackendScoreFn>(b"ggml_backend_score\0") }
                        .ok()
                        // SAFETY: calling the plugin's score function, which takes no arguments.
                        .map(|f| unsafe { f() });
                    // SAFETY: only checking presence.
                    let has_init = unsafe { lib.get::<sys::BackendInitFn>(b"ggml_backend_init\0") }.is_ok();
                    if !has_init {
                        self.skip(path, SkipReason::NoInitSymbol);
                    } else if score == Some(0) {
                        self.skip(path, SkipReason::UnusableOnThisCpu);
                    } else {
                        candidates.push(Candidate { path, lib, score });
                    }
                }
                Err(reason) => self.skip(path, reason),
            }
        }
        // Highest score first; a plugin without a score function counts as 1.
        candidates.sort_by_key(|c| std::cmp::Reverse(c.score.unwrap_or(1)));
        let mut winner: Option<(PathBuf, i32)> = None;
        for c in candidates {
            if let Some((by, winner_score)) = &winner {
                self.skip(
                    c.path,
                    SkipReason::Superseded { by: by.clone(), score: c.score.unwrap_or(1), winner_score: *winner_score },
                );
                continue;
            }
            // SAFETY: checked above that the symbol exists; its type is ggml's init.
            let init = unsafe { c.lib.get::<sys::BackendInitFn>(b"ggml_backend_init\0") }.ok()?;
            // SAFETY: calling the plugin's init, which takes no arguments.
            let raw = unsafe { init() };
            if raw.is_null() {
                self.skip(c.path, SkipReason::InitFailed);
                continue;
            }
            // SAFETY: raw is a registration returned by init.
            let found = unsafe { sys::backend_reg_api_version(raw) };
            if found != sys::GGML_BACKEND_API_VERSION {
                self.skip(c.path, SkipReason::ApiVersionMismatch { found, expected: sys::GGML_BACKEND_API_VERSION });
                // The library stays loaded: its init ran and may have started state.
                std::mem::forget(c.lib);
                continue;
            }
            let handle = RegHandle(raw);
            let name = handle.name();
            tracing::debug!(plugin = %c.path.display(), name, score = ?c.score, "loaded plugin");
            winner = Some((c.path.clone(), c.score.unwrap_or(1)));
            self.plugins.push(LoadedPlugin { name, path: c.path, score: c.score, endpoint: None, reg: handle });
            // Never unloaded.
            std::mem::forget(c.lib);
        }
        winner.map(|(p, _)| p)
    }

    /// The directories searched, in order, with their origin.
    pub fn searched(&self) -> &[(PathBuf, &'static str)] {
        &self.searched
    }

    /// The registrations in use.
    pub fn plugins(&self) -> &[LoadedPlugin] {
        &self.plugins
    }

    /// The files not used, with reasons.
    pub fn skipped(&self) -> &[SkippedPlugin] {
        &self.skipped
    }

    /// Every device of every loaded registration, in load order.
    pub fn devices(&self) -> Vec<Device> {
        self.plugins.iter().flat_map(|p| p.reg.devices()).collect()
    }

    /// The plugin that provides a device.
    pub fn plugin_of(&self, device: &Device) -> Option<&LoadedPlugin> {
        // RPC devices report the RPC plugin's static registration as their
        // owner, not the per-server one that lists them: match by listing first.
        self.plugins
            .iter()
            .find(|p| p.reg.devices().contains(device))
            .or_else(|| self.plugins.iter().find(|p| p.reg.0 == device.reg_raw()))
    }

    /// Finds a device by exact (case-insensitive) name.
    pub fn device(&self, name: &str) -> Result<Device> {
        let devices = self.devices();
        devices.iter().find(|d| d.name().eq_ignore_ascii_case(name)).copied().ok_or_else(|| {
            BackendError::UnknownDevice {
                name: name.to_string(),
                available: devices.iter().map(|d| d.name()).collect::<Vec<_>>().join(", "),
            }
        })
    }

    /// The first loaded registration whose name starts with `prefix` (case-insensitive).
    pub(crate) fn reg_named(&self, prefix: &str) -> Option<&LoadedPlugin> {
        self.plugins.iter().find(|p| p.name.to_ascii_lowercase().starts_with(&prefix.to_ascii_lowercase()))
    }

    fn searched_list(&self) -> String {
        self.searched.iter().map(|(d, _)| d.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    /// Connects to a `sd-cli rpc-server` and adds its devices. The endpoint is
    /// probed first (connect and protocol handshake with a timeout), because
    /// ggml's RPC client aborts the process when a server is unreachable.
    pub fn add_rpc_server(&mut self, endpoint: &str) -> Result<Vec<Device>> {
        let rpc_plugin = self
            .reg_named("RPC")
            .filter(|p| p.endpoint.is_none())
            .ok_or_else(|| BackendError::PluginMissing("RPC".into(), self.searched_list()))?
            .clone();
        if let Some(p) = self.plugins.iter().find(|p| p.endpoint.as_deref() == Some(endpoint)) {
            return Ok(p.reg.devices());
        }
        rpc::probe(endpoint, rpc::PROBE_TIMEOUT)?;
        rpc::prepare_client(&rpc_plugin)?;
        let add = rpc_plugin.reg.proc(c"ggml_backend_rpc_add_server").ok_or_else(|| BackendError::MissingProc {
            plugin: rpc_plugin.path.display().to_string(),
            symbol: "ggml_backend_rpc_add_server".into(),
        })?;
        // SAFETY: the RPC plugin exports this function with the RpcAddServerFn signature (ggml-rpc.h).
        let add: sys::RpcAddServerFn = unsafe { std::mem::transmute(add) };
        let c_endpoint = std::ffi::CString::new(endpoint).map_err(|_| BackendError::BadEndpoint(endpoint.into()))?;
        // SAFETY: the endpoint was probed (reachable, protocol matches); the function
        // copies the string.
        let raw = unsafe { add(c_endpoint.as_ptr()) };
        if raw.is_null() {
            rpc::check_lost()?;
            return Err(BackendError::RpcUnreachable {
                endpoint: endpoint.into(),
                reason: "the server reports no devices".into(),
            });
        }
        let handle = RegHandle(raw);
        let devices = handle.devices();
        rpc::check_lost()?;
        rpc::remember_devices(endpoint, devices.iter().map(|d| d.name()).collect());
        self.plugins.push(LoadedPlugin {
            name: handle.name(),
            path: rpc_plugin.path.clone(),
            score: None,
            endpoint: Some(endpoint.to_string()),
            reg: handle,
        });
        Ok(devices)
    }
}

/// `libggml-cpu-haswell.so` -> `cpu`; `libggml-rpc.so` -> `rpc` (`ggml-rpc.dll` on Windows:
/// the names of `ggml_sys::names`); other files -> None.
fn backend_name_of(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let target = sys::names::plugin_target(sys::names::TargetOs::current(), file)?;
    let name = target.strip_prefix("ggml-")?.split('-').next()?;
    (!name.is_empty()).then(|| name.to_ascii_lowercase())
}

fn open_library(path: &Path) -> std::result::Result<Library, SkipReason> {
    let meta = std::fs::metadata(path).map_err(|e| SkipReason::NotAPlugin { detail: e.to_string() })?;
    if !meta.is_file() {
        return Err(SkipReason::NotAPlugin { detail: "not a regular file".into() });
    }
    if meta.len() == 0 {
        return Err(SkipReason::NotAPlugin { detail: "empty file".into() });
    }
    // SAFETY: loading a shared library runs its initialisers; we only load files
    // named like ggml plugins from the directories the user configured, which is
    // the trust model of ggml's own loader.
    unsafe { Library::new(path) }.map_err(|e| {
        let detail = e.to_string();
        // The file itself exists (checked above), so "cannot open shared object
        // file" names a dependency that dlopen could not find.
        if detail.contains("cannot open shared object file") {
            SkipReason::MissingDependency { detail }
        } else {
            SkipReason::NotAPlugin { detail }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_from_file_names() {
        let n = |s: &str| backend_name_of(Path::new(s));
        assert_eq!(n("/x/libggml-cpu-haswell.so").as_deref(), Some("cpu"));
        assert_eq!(n("/x/libggml-rpc.so").as_deref(), Some("rpc"));
        assert_eq!(n("/x/libggml-base.so"), None);
        assert_eq!(n("/x/libggml-cpu.so.tmp"), None);
        assert_eq!(n("/x/ggml-cpu.so"), None);
    }

    #[test]
    fn relative_dirs_become_absolute_and_cwd_is_not_searched() {
        let s = PluginSearch::only(vec![PathBuf::from("rel")]);
        let dirs = s.directories();
        assert_eq!(dirs.len(), 1);
        assert!(dirs[0].0.is_absolute());
        let s = PluginSearch::standard(vec![]);
        let cwd = std::env::current_dir().unwrap();
        assert!(s
            .directories()
            .iter()
            .all(|(d, _)| d != &cwd || d == &std::env::current_exe().unwrap().parent().unwrap().to_path_buf()));
    }
}
