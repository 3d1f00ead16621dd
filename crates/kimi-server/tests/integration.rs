//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. kimi-cli's `test_layout.rs` keeps
//! the list whole.

#[path = "abuse.rs"]
mod abuse;
#[path = "api.rs"]
mod api;
#[path = "bad_requests.rs"]
mod bad_requests;
mod common;
#[path = "offload.rs"]
mod offload;
#[path = "redis_limits.rs"]
mod redis_limits;
#[path = "serving.rs"]
mod serving;
#[path = "web.rs"]
mod web;
#[path = "xtml.rs"]
mod xtml;
