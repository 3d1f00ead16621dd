//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. `every_test_file_is_listed` keeps the list whole.

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

/// A test file under `tests/` that is neither a module here nor its own `[[test]]` would
/// never run: each must be one of them.
#[test]
fn every_test_file_is_listed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = include_str!("integration.rs");
    let separate: [&str; 0] = [];
    for entry in std::fs::read_dir(&dir).expect("tests/ readable") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if !name.ends_with(".rs") || name == "integration.rs" || separate.contains(&name.as_str()) {
            continue;
        }
        let listed = format!("#[path = \"{name}\"]");
        assert!(
            this.contains(&listed),
            "tests/{name} is not a module of tests/integration.rs"
        );
    }
}
