//! The built-in demo model: a tiny random-weight Kimi Linear and a small Kimi-style
//! tokenizer, compiled into the binary so `kimi-infer run` works with no download.

use std::path::PathBuf;

use anyhow::Context;

const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../assets/demo-model/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../assets/demo-model/model.safetensors"),
    ),
    (
        "tiktoken.model",
        include_bytes!("../../../assets/demo-tokenizer/tiktoken.model"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../assets/demo-tokenizer/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../../../assets/demo-tokenizer/chat_template.jinja"),
    ),
];

/// Writes the demo files to a cache folder (once per content) and returns it.
pub fn demo_dir() -> anyhow::Result<PathBuf> {
    let mut hash: u64 = 0xcbf29ce484222325;
    for (name, bytes) in FILES {
        for b in name.bytes().chain(bytes.iter().copied()) {
            hash = (hash ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("kimi-infer").join(format!("demo-{hash:016x}"));
    if dir.join("done").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    std::fs::write(dir.join("done"), b"").with_context(|| format!("writing {}", dir.display()))?;
    Ok(dir)
}
