//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. kimi-cli's `test_layout.rs` keeps
//! the list whole.

mod common;
#[path = "demo_asset.rs"]
mod demo_asset;
#[path = "hf_tokenizer_json.rs"]
mod hf_tokenizer_json;
#[path = "kimi_chat_template.rs"]
mod kimi_chat_template;
#[path = "load_errors.rs"]
mod load_errors;
#[path = "tiktoken_cl100k.rs"]
mod tiktoken_cl100k;
