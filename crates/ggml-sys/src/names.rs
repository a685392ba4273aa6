//! File names of ggml's core library and backend plugins on each target OS: one pure function each, used by the build and the loader.
//!
//! Plugins follow ggml's dynamic-backend convention (`ggml-backend-reg.cpp`'s
//! `backend_filename_prefix`/`_extension`): `libggml-<backend>[-<variant>].so` on Linux and
//! macOS alike (ggml loads `.so` plugins on macOS too), `ggml-<backend>[-<variant>].dll` on
//! Windows. The core library follows each platform's linker conventions: `libggml-base.so.X.Y.Z`
//! with soname `libggml-base.so.X` on Linux (and the other ELF systems), `libggml-base.X.dylib`
//! on macOS (`libggml-base.dylib` to link by), `ggml-base.dll` on Windows (MSVC and MinGW
//! alike: its import library `ggml-base.lib` / `libggml-base.dll.a` is what links).
//!
//! This module is also compiled into the build script (`#[path]`), which reads the target
//! from `CARGO_CFG_TARGET_OS`: the names of what is built and what is loaded cannot drift.

/// The operating-system families whose naming differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetOs {
    /// Linux, the BSDs, Android and the other ELF systems.
    Elf,
    /// macOS (and iOS).
    MacOs,
    /// Windows (MSVC or MinGW).
    Windows,
}

impl TargetOs {
    /// The OS this code was compiled for.
    pub const fn current() -> Self {
        if cfg!(windows) {
            TargetOs::Windows
        } else if cfg!(target_vendor = "apple") {
            TargetOs::MacOs
        } else {
            TargetOs::Elf
        }
    }

    /// The family of a `CARGO_CFG_TARGET_OS` value (`linux`, `macos`, `windows`, ...).
    pub fn from_target_os(os: &str) -> Self {
        match os {
            "windows" => TargetOs::Windows,
            "macos" | "ios" | "tvos" | "watchos" | "visionos" => TargetOs::MacOs,
            _ => TargetOs::Elf,
        }
    }

    fn plugin_prefix(self) -> &'static str {
        match self {
            TargetOs::Windows => "",
            _ => "lib",
        }
    }

    fn plugin_suffix(self) -> &'static str {
        match self {
            TargetOs::Windows => ".dll",
            _ => ".so",
        }
    }
}

/// The file of plugin `target` (`ggml-cpu-haswell`, `ggml-rpc`): `libggml-cpu-haswell.so`,
/// or `ggml-cpu-haswell.dll` on Windows.
pub fn plugin_file(os: TargetOs, target: &str) -> String {
    format!("{}{target}{}", os.plugin_prefix(), os.plugin_suffix())
}

/// The plugin target a file name is (`libggml-rpc.so` -> `ggml-rpc`); `None` for a name that
/// is not a ggml plugin of `os` (the core library, a `.tmp`, another prefix or suffix).
pub fn plugin_target(os: TargetOs, file: &str) -> Option<&str> {
    let target = file.strip_prefix(os.plugin_prefix())?.strip_suffix(os.plugin_suffix())?;
    (target.starts_with("ggml-") && target != "ggml-base").then_some(target)
}

/// The names of the core library `libggml-base` of ggml `version` (`0.9.4`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreNames {
    /// The file built.
    pub file: String,
    /// The name the executable records and the loader looks for (the ELF soname, the macOS
    /// install name's file; the file itself on Windows).
    pub soname: String,
    /// Further names (links to `file`) that the linker finds it by (`-lggml-base`) or that
    /// the soname is; empty on Windows.
    pub aliases: Vec<String>,
}

/// The core library's names on `os`.
pub fn core_names(os: TargetOs, version: &str) -> CoreNames {
    let major = version.split('.').next().filter(|m| !m.is_empty()).unwrap_or("0");
    match os {
        TargetOs::Elf => CoreNames {
            file: format!("libggml-base.so.{version}"),
            soname: format!("libggml-base.so.{major}"),
            aliases: vec![format!("libggml-base.so.{major}"), "libggml-base.so".into()],
        },
        TargetOs::MacOs => CoreNames {
            file: format!("libggml-base.{version}.dylib"),
            soname: format!("libggml-base.{major}.dylib"),
            aliases: vec![format!("libggml-base.{major}.dylib"), "libggml-base.dylib".into()],
        },
        TargetOs::Windows => {
            CoreNames { file: "ggml-base.dll".into(), soname: "ggml-base.dll".into(), aliases: Vec::new() }
        }
    }
}

/// Whether `file` is one of the core library's names on `os` (any version).
pub fn is_core_file(os: TargetOs, file: &str) -> bool {
    match os {
        TargetOs::Elf => file == "libggml-base.so" || file.starts_with("libggml-base.so."),
        TargetOs::MacOs => file.starts_with("libggml-base.") && file.ends_with(".dylib"),
        TargetOs::Windows => file == "ggml-base.dll",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_and_other_elf_systems() {
        let os = TargetOs::from_target_os("linux");
        assert_eq!(os, TargetOs::from_target_os("freebsd"));
        assert_eq!(plugin_file(os, "ggml-cpu-haswell"), "libggml-cpu-haswell.so");
        assert_eq!(plugin_target(os, "libggml-rpc.so"), Some("ggml-rpc"));
        assert_eq!(plugin_target(os, "libggml-base.so"), None);
        assert_eq!(plugin_target(os, "libggml-cpu.so.tmp"), None);
        assert_eq!(plugin_target(os, "ggml-cpu.dll"), None);
        let core = core_names(os, "0.9.4");
        assert_eq!((core.file.as_str(), core.soname.as_str()), ("libggml-base.so.0.9.4", "libggml-base.so.0"));
        assert_eq!(core.aliases, ["libggml-base.so.0", "libggml-base.so"]);
        assert!(is_core_file(os, "libggml-base.so.0") && is_core_file(os, "libggml-base.so"));
        assert!(!is_core_file(os, "libggml-rpc.so"));
    }

    #[test]
    fn macos() {
        let os = TargetOs::from_target_os("macos");
        assert_eq!(os, TargetOs::MacOs);
        // ggml's loader looks for `.so` plugins on macOS as well
        assert_eq!(plugin_file(os, "ggml-metal"), "libggml-metal.so");
        assert_eq!(plugin_target(os, "libggml-metal.so"), Some("ggml-metal"));
        assert_eq!(plugin_target(os, "libggml-metal.dylib"), None);
        let core = core_names(os, "0.9.4");
        assert_eq!((core.file.as_str(), core.soname.as_str()), ("libggml-base.0.9.4.dylib", "libggml-base.0.dylib"));
        assert_eq!(core.aliases, ["libggml-base.0.dylib", "libggml-base.dylib"]);
        assert!(is_core_file(os, "libggml-base.dylib") && !is_core_file(os, "libggml-base.so.0"));
    }

    #[test]
    fn windows() {
        let os = TargetOs::from_target_os("windows");
        assert_eq!(os, TargetOs::Windows);
        assert_eq!(plugin_file(os, "ggml-vulkan"), "ggml-vulkan.dll");
        assert_eq!(plugin_target(os, "ggml-cpu-haswell.dll"), Some("ggml-cpu-haswell"));
        assert_eq!(plugin_target(os, "libggml-cpu-haswell.so"), None);
        assert_eq!(plugin_target(os, "ggml-base.dll"), None);
        let core = core_names(os, "0.9.4");
        assert_eq!((core.file.as_str(), core.soname.as_str()), ("ggml-base.dll", "ggml-base.dll"));
        assert!(core.aliases.is_empty());
        assert!(is_core_file(os, "ggml-base.dll"));
    }

    #[test]
    fn this_build_names_its_files_for_its_own_os() {
        let os = TargetOs::current();
        let file = plugin_file(os, "ggml-cpu-x64");
        assert_eq!(plugin_target(os, &file), Some("ggml-cpu-x64"));
        assert!(file.ends_with(std::env::consts::DLL_SUFFIX) || os == TargetOs::MacOs, "{file}");
    }
}
