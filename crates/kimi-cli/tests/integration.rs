//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. kimi-cli's `test_layout.rs` keeps
//! the list whole.

#[path = "cli.rs"]
mod cli;
#[path = "gateway.rs"]
mod gateway;
#[path = "gateway_access.rs"]
mod gateway_access;
#[path = "hub.rs"]
mod hub;
#[path = "perplexity.rs"]
mod perplexity;
#[path = "quantize.rs"]
mod quantize;
#[path = "ranks.rs"]
mod ranks;
#[path = "serve.rs"]
mod serve;
mod support;
#[path = "test_layout.rs"]
mod test_layout;
