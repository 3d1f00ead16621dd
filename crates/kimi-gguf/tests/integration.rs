//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. kimi-cli's `test_layout.rs` keeps
//! the list whole.

mod common;
#[path = "malformed.rs"]
mod malformed;
#[path = "oracle.rs"]
mod oracle;
#[path = "quant_error.rs"]
mod quant_error;
#[path = "real_file.rs"]
mod real_file;
#[path = "roundtrip.rs"]
mod roundtrip;
