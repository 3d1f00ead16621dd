//! Every crate's integration tests run: a crate whose test files are modules of one binary
//! (`autotests = false`, `tests/integration.rs`) lists each file under `tests/` either as a
//! module there or as its own `[[test]]` in its Cargo.toml, or the file would never run.

use std::path::Path;

#[test]
fn every_test_file_is_a_module_or_its_own_test() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    for entry in std::fs::read_dir(&crates).expect("crates/ readable") {
        let dir = entry.expect("entry").path();
        let Ok(manifest) = std::fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        if !manifest.contains("autotests = false") {
            continue;
        }
        let Ok(modules) = std::fs::read_to_string(dir.join("tests/integration.rs")) else {
            panic!(
                "{}: autotests off but no tests/integration.rs",
                dir.display()
            );
        };
        for file in std::fs::read_dir(dir.join("tests")).expect("tests/ readable") {
            let name = file
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            if !name.ends_with(".rs") || name == "integration.rs" {
                continue;
            }
            let as_module = format!("#[path = \"{name}\"]");
            let as_test = format!("path = \"tests/{name}\"");
            assert!(
                modules.contains(&as_module) || manifest.contains(&as_test),
                "{}/tests/{name} is neither a module of tests/integration.rs nor a [[test]]",
                dir.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} test files found");
}
