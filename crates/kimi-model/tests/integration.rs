//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. kimi-cli's `test_layout.rs` keeps
//! the list whole.

#[path = "awq_groups.rs"]
mod awq_groups;
mod common;
#[path = "fp8_cache.rs"]
mod fp8_cache;
#[path = "gguf_kimi.rs"]
mod gguf_kimi;
#[path = "golden.rs"]
mod golden;
#[path = "llama_gguf.rs"]
mod llama_gguf;
#[path = "native_names.rs"]
mod native_names;
#[path = "offload.rs"]
mod offload;
#[path = "parallel.rs"]
mod parallel;
#[path = "parallel_tiers.rs"]
mod parallel_tiers;
#[path = "process.rs"]
mod process;
#[path = "quantized.rs"]
mod quantized;
#[path = "rebalance.rs"]
mod rebalance;
