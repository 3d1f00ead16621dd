//! Every integration test of this crate but those named as their own `[[test]]` in
//! Cargo.toml, in one binary: each file under `tests/` runs as a module of it (its tests are
//! `file::test_name`). One binary links once where one per file linked each time, which
//! was minutes of CI's test build. `every_test_file_is_listed` keeps the list whole.

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

/// A test file under `tests/` that is neither a module here nor its own `[[test]]` would
/// never run: each must be one of them.
#[test]
fn every_test_file_is_listed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = include_str!("integration.rs");
    let separate: [&str; 1] = ["access_log.rs"];
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
