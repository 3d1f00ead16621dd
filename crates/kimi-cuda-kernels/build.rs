//! With the `cuda` feature: compiles every `kernels/*.cu` with `$CUDA_HOME/bin/nvcc` to an
//! `sm_90a` cubin in OUT_DIR and writes `cubins.rs`, which embeds them with `include_bytes!`.
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
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src
            .file_stem()
            .expect("file name")
            .to_string_lossy()
            .into_owned();
        let cubin = out_dir.join(format!("{stem}.cubin"));
        let status = Command::new(&nvcc)
            .args([
                "-std=c++17",
                "-O3",
                "-gencode=arch=compute_90a,code=sm_90a",
                "-cubin",
                "-Ikernels",
                "-o",
            ])
            .arg(&cubin)
            .arg(src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
        entries.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?}) as &[u8]),\n",
            cubin.display().to_string()
        ));
    }
    entries.push_str("]\n");
    fs::write(&table, entries).expect("OUT_DIR is writable");
}
