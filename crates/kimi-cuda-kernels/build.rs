//! With the `cuda` feature: compiles every `kernels/*.cu` with `$CUDA_HOME/bin/nvcc` to an
//! `sm_90a` cubin in OUT_DIR and writes `cubins.rs`, which embeds them with `include_bytes!`;
//! compiles every `cutlass/*.cu` and `flashinfer/*.cu` (device and host code) against the
//! FlashInfer, CUTLASS and CCCL headers of the pinned `flashinfer-python` wheel
//! (`$KIMI_FLASHINFER_DIR`, default `$CUDA_HOME/../../flashinfer`, both made by
//! `scripts/cuda/setup.sh`) into a static library linked with the static CUDA runtime.
//! Without it: writes an empty table and needs no toolkit.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let table = out_dir.join("cubins.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        fs::write(&table, "&[]\n").expect("OUT_DIR is writable");
        return;
    }
    let nvcc = match env::var("CUDA_HOME") {
        Ok(home) => Path::new(&home).join("bin").join("nvcc"),
        Err(_) => {
            panic!("the `cuda` feature needs CUDA_HOME (run scripts/cuda/setup.sh and export what it prints)")
        }
    };
    let mut sources: Vec<PathBuf> = fs::read_dir("kernels")
        .expect("kernels/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut entries = String::from("&[\n");
    let mut jobs = Vec::new();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src
            .file_stem()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        let cubin = out_dir.join(format!("{stem}.cubin"));
        let mut cmd = Command::new(&nvcc);
        cmd.args([
            "-std=c++17",
            "-O3",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-cubin",
            "-Ikernels",
            "-o",
        ])
        .arg(&cubin)
        .arg(src);
        jobs.push((src.clone(), cmd));
        entries.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?}) as &[u8]),\n",
            cubin.display().to_string()
        ));
    }
    entries.push_str("]\n");
    let (cutlass_jobs, objects) = cutlass_jobs(&nvcc, &out_dir);
    jobs.extend(cutlass_jobs);
    run_all(&nvcc, jobs);
    fs::write(&table, entries).expect("OUT_DIR is writable");
    link_cutlass(&nvcc, &out_dir, &objects);
}

/// Runs the nvcc jobs `NUM_JOBS` at a time (cargo's `-j`): one at a time they were most
/// of a CUDA build's wall time on two cores.
fn run_all(nvcc: &Path, jobs: Vec<(PathBuf, Command)>) {
    let workers = env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, jobs.len().max(1));
    let queue = std::sync::Mutex::new(jobs.into_iter());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let next = queue.lock().expect("no worker panics holding it").next();
                let Some((src, mut cmd)) = next else { break };
                let status = cmd
                    .status()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
                assert!(status.success(), "nvcc failed on {}", src.display());
            });
        }
    });
}

/// The nvcc jobs that compile `cutlass/*.cu` and `flashinfer/*.cu` into objects for
/// `libkimi_cutlass.a` ([`link_cutlass`]). One CUTLASS for both (the one FlashInfer
/// bundles), so that no two versions of its inline host code meet in one binary.
fn cutlass_jobs(nvcc: &Path, out_dir: &Path) -> (Vec<(PathBuf, Command)>, Vec<PathBuf>) {
    println!("cargo:rerun-if-changed=cutlass");
    println!("cargo:rerun-if-changed=flashinfer");
    println!("cargo:rerun-if-env-changed=KIMI_FLASHINFER_DIR");
    let cuda_home = nvcc
        .parent()
        .and_then(Path::parent)
        .expect("nvcc lives in $CUDA_HOME/bin")
        .to_path_buf();
    let fi = env::var_os("KIMI_FLASHINFER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cuda_home.join("../../flashinfer"));
    // The bundled CCCL first: the toolkit's 13.0 copy lacks what FlashInfer uses.
    let includes = [
        "cccl/libcudacxx/include",
        "cccl/cub",
        "cccl/thrust",
        "include",
        "cutlass/include",
        "cutlass/tools/util/include",
    ]
    .map(|d| fi.join(d));
    for (dir, probe) in [
        (&includes[3], "flashinfer/attention/hopper/prefill_sm90.cuh"),
        (&includes[4], "cutlass/cutlass.h"),
    ] {
        assert!(
            dir.join(probe).exists(),
            "{probe} not found under {} (run scripts/cuda/setup.sh)",
            dir.display()
        );
    }
    let mut sources: Vec<PathBuf> = ["cutlass", "flashinfer"]
        .iter()
        .flat_map(|dir| fs::read_dir(dir).expect("source folder exists"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut jobs = Vec::new();
    let mut objects = Vec::new();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src.file_stem().expect("file name").to_string_lossy();
        let obj = out_dir.join(format!("{stem}.o"));
        let mut cmd = Command::new(nvcc);
        cmd.args([
            "-std=c++17",
            "-O3",
            // Without NDEBUG, CUTLASS's asserts split the wgmma pipeline (ptxas C7510).
            "-DNDEBUG",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            "-gencode=arch=compute_90a,code=sm_90a",
            // Warnings inside the third-party headers (defaulted __device__ constructors,
            // C++20 captures, unused functions).
            "-diag-suppress=20012,3357,1444,177",
            "-Xcompiler",
            "-fPIC",
            "-c",
        ]);
        for inc in &includes {
            cmd.arg("-I").arg(inc);
        }
        cmd.arg("-o").arg(&obj).arg(src);
        jobs.push((src.clone(), cmd));
        objects.push(obj);
    }
    (jobs, objects)
}

/// `libkimi_cutlass.a` from the compiled objects, plus the link lines for it and the static
/// CUDA runtime (which loads the driver at run time: the binary still starts without one).
fn link_cutlass(nvcc: &Path, out_dir: &Path, objects: &[PathBuf]) {
    let cuda_home = nvcc
        .parent()
        .and_then(Path::parent)
        .expect("nvcc lives in $CUDA_HOME/bin")
        .to_path_buf();
    let lib = out_dir.join("libkimi_cutlass.a");
    let _ = fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .args(objects)
        .status()
        .unwrap_or_else(|e| panic!("cannot run ar: {e}"));
    assert!(status.success(), "ar failed on {}", lib.display());
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=kimi_cutlass");
    println!(
        "cargo:rustc-link-search=native={}",
        cuda_home.join("lib").display()
    );
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}
