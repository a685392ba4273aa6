//! Real plugins, real devices: the CPU plugin, an RPC server on loopback, and broken plugin files.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sd_backends::{Backend, Context, Device, DeviceKind, GraphAllocator, PluginRegistry, PluginSearch, SkipReason};

fn install_dir() -> PathBuf {
    PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)
}

fn registry() -> PluginRegistry {
    PluginRegistry::discover(&PluginSearch::only(vec![install_dir()]))
}

/// softmax(W x + b) over rows, in plain Rust. W is [m][k], x is [n][k], b is [n][m].
fn reference(w: &[f32], x: &[f32], b: &[f32], k: usize, m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for j in 0..n {
        let mut row: Vec<f64> = (0..m)
            .map(|i| (0..k).map(|t| w[i * k + t] as f64 * x[j * k + t] as f64).sum::<f64>() + b[j * m + i] as f64)
            .collect();
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = row
            .iter_mut()
            .map(|v| {
                *v = (*v - max).exp();
                *v
            })
            .sum();
        for i in 0..m {
            out[j * m + i] = (row[i] / sum) as f32;
        }
    }
    out
}

fn inputs(k: usize, m: usize, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let f = |i: usize, s: f32| (i as f32 * 0.37 + s).sin() * 0.8;
    (
        (0..m * k).map(|i| f(i, 0.1)).collect(),
        (0..n * k).map(|i| f(i, 1.7)).collect(),
        (0..n * m).map(|i| f(i, 2.9)).collect(),
    )
}

/// Builds softmax(mul_mat(W, x) + b) and computes it on `backend`.
fn compute_on(backend: &Backend) -> Vec<f32> {
    let (k, m, n) = (64usize, 17usize, 5usize);
    let (w, x, b) = inputs(k, m, n);
    let params = Context::for_tensors(3).unwrap();
    let tw = params.new_f32(&[k as i64, m as i64]).set_name("w");
    let tx = params.new_f32(&[k as i64, n as i64]).set_name("x");
    let tb = params.new_f32(&[m as i64, n as i64]).set_name("b");
    let buft = backend.device().buffer_type();
    // SAFETY: `_buf` lives to the end of the function, past every use of the tensors.
    let _buf = unsafe { buft.alloc_ctx_tensors(&params) }.unwrap().unwrap();
    tw.set_f32(&w).unwrap();
    tx.set_f32(&x).unwrap();
    tb.set_f32(&b).unwrap();

    let g = Context::for_graph(16, 16).unwrap();
    let y = g.soft_max(g.add(g.mul_mat(tw, tx), tb));
    y.set_output();
    let graph = g.new_graph(16);
    graph.expand(y);
    let mut alloc = GraphAllocator::new(buft);
    assert!(alloc.measure(&graph) > 0);
    // SAFETY: `alloc` lives to the end of the function, past every use of the graph's data.
    unsafe { alloc.alloc_graph(&graph) }.unwrap();
    backend.compute(&graph).unwrap();
    assert_eq!(y.shape(), [m as i64, n as i64, 1, 1]);
    let out = y.get_f32().unwrap();
    let want = reference(&w, &x, &b, k, m, n);
    for (i, (a, e)) in out.iter().zip(&want).enumerate() {
        assert!((a - e).abs() < 1e-5, "element {i}: got {a}, want {e}");
    }
    out
}

#[test]
fn cpu_plugin_loads_and_computes_like_plain_rust() {
    let reg = registry();
    let cpu = reg.devices().into_iter().find(|d| d.kind() == DeviceKind::Cpu).expect("a CPU device");
    let (free, total) = cpu.memory();
    assert!(total > 0 && free > 0, "CPU reports its memory");
    let plugin = reg.plugin_of(&cpu).unwrap();
    assert!(plugin.path.file_name().unwrap().to_str().unwrap().starts_with("libggml-cpu-"));
    assert!(plugin.score.unwrap_or(0) > 0, "the chosen CPU variant has a positive score");
    // Every other CPU variant in the directory was either superseded or unusable.
    for s in reg.skipped() {
        assert!(
            matches!(s.reason, SkipReason::Superseded { .. } | SkipReason::UnusableOnThisCpu),
            "unexpected skip {s:?}"
        );
    }
    let backend = Backend::new(cpu).unwrap();
    backend.set_threads(2);
    compute_on(&backend);
}

#[test]
fn backend_manager_shares_one_instance_per_device() {
    let reg = registry();
    let cpu = reg.device("cpu").unwrap();
    let m = sd_backends::BackendManager::new(Some(1));
    let a = m.get(cpu).unwrap();
    let b = m.get(cpu).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(m.len(), 1);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start_server(reg: &'static PluginRegistry) -> u16 {
    let port = free_port();
    let cpu = reg.device("cpu").unwrap();
    std::thread::spawn(move || {
        sd_backends::rpc::serve(reg, "127.0.0.1", port, &[cpu], 1, None).unwrap();
    });
    // Wait until it accepts connections.
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The probe connection above was accepted and dropped; give the server a
    // moment to return to accept().
    std::thread::sleep(Duration::from_millis(50));
    port
}

#[test]
fn rpc_device_computes_the_same_numbers() {
    let server_reg: &'static PluginRegistry = Box::leak(Box::new(registry()));
    let port = start_server(server_reg);
    let mut client = registry();
    let local = compute_on(&Backend::new(client.device("cpu").unwrap()).unwrap());
    let devices = client.add_rpc_server(&format!("127.0.0.1:{port}")).unwrap();
    assert_eq!(devices.len(), 1);
    let rpc: Device = devices[0];
    assert!(rpc.name().starts_with("RPC"), "{}", rpc.name());
    assert!(client.devices().contains(&rpc), "remote device listed like a local one");
    let info = client.device_infos().into_iter().find(|i| i.name == rpc.name()).unwrap();
    assert!(info.plugin.contains(&format!("127.0.0.1:{port}")));
    assert!(info.memory_total > 0);
    let remote = compute_on(&Backend::new(rpc).unwrap());
    assert_eq!(local, remote, "same kernels on the same CPU: identical results");
}

#[test]
fn unreachable_rpc_server_fails_fast_with_a_clear_error() {
    let mut client = registry();
    let port = free_port();
    let t = Instant::now();
    let err = client.add_rpc_server(&format!("127.0.0.1:{port}")).unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("cannot connect"), "{err}");
}

fn cc(src: &str, out: &std::path::Path) {
    let dir = out.parent().unwrap();
    let c = dir.join("src.c");
    std::fs::write(&c, src).unwrap();
    let st = std::process::Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(out).arg(&c).status().unwrap();
    assert!(st.success(), "cc failed");
    std::fs::remove_file(c).unwrap();
}

#[test]
fn broken_plugins_are_skipped_with_their_reasons() {
    let dir = std::env::temp_dir().join(format!("sd-plugins-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("libggml-empty.so"), b"").unwrap();
    std::fs::write(dir.join("libggml-x.so"), b"this is a text file, not a library\n").unwrap();
    cc("int not_a_backend(void) { return 1; }\n", &dir.join("libggml-noinit.so"));
    cc(
        "struct reg { int api_version; void *iface[8]; void *ctx; };\n\
         static struct reg r = { 999 };\n\
         void *ggml_backend_init(void) { return &r; }\n",
        &dir.join("libggml-oldapi.so"),
    );
    cc(
        "int ggml_backend_score(void) { return 0; }\nvoid *ggml_backend_init(void) { return 0; }\n",
        &dir.join("libggml-nocpu.so"),
    );
    cc(
        "extern int symbol_from_a_missing_library(void);\nint f(void) { return symbol_from_a_missing_library(); }\n",
        &dir.join("libggml-needsdep.so"),
    );
    // Make the last one depend on a library that does not exist.
    let stub = dir.join("libsd-missing-dep.so");
    cc("int symbol_from_a_missing_library(void) { return 0; }\n", &stub);
    let st = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libggml-needsdep.so"))
        .arg("-x")
        .arg("c")
        .arg("-")
        .arg(format!("-L{}", dir.display()))
        .arg("-lsd-missing-dep")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b"extern int symbol_from_a_missing_library(void);\nvoid *ggml_backend_init(void) { symbol_from_a_missing_library(); return 0; }\n")?;
            c.wait()
        })
        .unwrap();
    assert!(st.success());
    std::fs::remove_file(&stub).unwrap();

    let reg = PluginRegistry::discover(&PluginSearch::only(vec![dir.clone(), install_dir()]));
    let reason = |file: &str| {
        reg.skipped()
            .iter()
            .find(|s| s.path.file_name().unwrap() == file)
            .map(|s| s.reason.clone())
            .unwrap_or_else(|| panic!("{file} not skipped: {:?}", reg.skipped()))
    };
    assert!(matches!(reason("libggml-empty.so"), SkipReason::NotAPlugin { detail } if detail.contains("empty")));
    assert!(matches!(reason("libggml-x.so"), SkipReason::NotAPlugin { .. }));
    assert_eq!(reason("libggml-noinit.so"), SkipReason::NoInitSymbol);
    assert_eq!(
        reason("libggml-oldapi.so"),
        SkipReason::ApiVersionMismatch { found: 999, expected: ggml_sys::GGML_BACKEND_API_VERSION }
    );
    assert_eq!(reason("libggml-nocpu.so"), SkipReason::UnusableOnThisCpu);
    assert!(
        matches!(reason("libggml-needsdep.so"), SkipReason::MissingDependency { detail } if detail.contains("libsd-missing-dep"))
    );
    // The real plugins from the install dir still load.
    assert!(reg.devices().iter().any(|d| d.kind() == DeviceKind::Cpu));
    assert!(reg.plugins().iter().any(|p| p.name == "RPC"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn earlier_directories_shadow_later_ones() {
    let reg =
        PluginRegistry::discover(&PluginSearch::only(vec![install_dir(), install_dir().join("..").join("plugins")]));
    // The same directory twice is searched once (deduplicated), so nothing is shadowed.
    assert!(reg.skipped().iter().all(|s| !matches!(s.reason, SkipReason::Shadowed { .. })));
    let dir = std::env::temp_dir().join(format!("sd-plugins-shadow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(install_dir().join("libggml-rpc.so"), dir.join("libggml-rpc.so")).unwrap();
    let reg = PluginRegistry::discover(&PluginSearch::only(vec![dir.clone(), install_dir()]));
    let rpc = reg.plugins().iter().find(|p| p.name == "RPC").unwrap();
    assert_eq!(rpc.path, dir.join("libggml-rpc.so"));
    assert!(reg
        .skipped()
        .iter()
        .any(|s| matches!(&s.reason, SkipReason::Shadowed { by } if by == &dir.join("libggml-rpc.so"))));
    let _ = std::fs::remove_dir_all(&dir);
}
