//! Where the hub is, who we are to it and where its cache lives, read from the environment
//! variables `huggingface_hub` reads, so that both tools agree.

use std::path::{Path, PathBuf};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Endpoint, token, cache and offline mode.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// `HF_ENDPOINT` (a mirror), else the public hub; no trailing `/`.
    pub endpoint: String,
    /// `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`), else the token file that
    /// `hf auth login` writes (`HF_TOKEN_PATH`, else `$HF_HOME/token`).
    pub token: Option<String>,
    /// `HF_HUB_CACHE` (or `HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, with `HF_HOME`
    /// defaulting to `$XDG_CACHE_HOME/huggingface` or `~/.cache/huggingface`.
    pub cache_dir: PathBuf,
    /// `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is true: no network access at all.
    pub offline: bool,
}

impl HubConfig {
    /// The configuration of this process's environment.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The configuration from a lookup of environment variables (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        let home = set("HOME").map(PathBuf::from);
        let expand = |p: String| expand_home(&p, home.as_deref());
        let hf_home = set("HF_HOME").map(expand).unwrap_or_else(|| {
            let cache = set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("huggingface")
        });
        let cache_dir = set("HF_HUB_CACHE")
            .or_else(|| set("HUGGINGFACE_HUB_CACHE"))
            .map(expand)
            .unwrap_or_else(|| hf_home.join("hub"));
        let endpoint = set("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let token = set("HF_TOKEN")
            .or_else(|| set("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let path = set("HF_TOKEN_PATH")
                    .map(expand)
                    .unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(path).ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let offline = is_true(set("HF_HUB_OFFLINE").or_else(|| set("TRANSFORMERS_OFFLINE")));
        Self {
            endpoint,
            token,
            cache_dir,
            offline,
        }
    }
}

/// `huggingface_hub`'s truth: `1`, `ON`, `YES` or `TRUE` in any case.
fn is_true(value: Option<String>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_uppercase().as_str(),
            "1" | "ON" | "YES" | "TRUE"
        )
    })
}

fn expand_home(path: &str, home: Option<&Path>) -> PathBuf {
    match (path.strip_prefix("~/"), home) {
        (Some(rest), Some(home)) => home.join(rest),
        _ if path == "~" => home.map_or_else(|| PathBuf::from(path), Path::to_path_buf),
        _ => PathBuf::from(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> HubConfig {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_vars(|k| vars.get(k).cloned())
    }

    #[test]
    fn defaults_follow_huggingface_hub() {
        let c = config(&[("HOME", "/home/u")]);
        assert_eq!(c.endpoint, "https://huggingface.co");
        assert_eq!(c.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert!(!c.offline);
        let c = config(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")]);
        assert_eq!(c.cache_dir, PathBuf::from("/xdg/huggingface/hub"));
        let c = config(&[("HOME", "/home/u"), ("HF_HOME", "~/hf")]);
        assert_eq!(c.cache_dir, PathBuf::from("/home/u/hf/hub"));
    }

    #[test]
    fn variables_override() {
        let c = config(&[
            ("HOME", "/home/u"),
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/big/disk"),
            ("HF_ENDPOINT", "https://mirror.example/"),
            ("HF_TOKEN", " hf_abc \n"),
            ("HF_HUB_OFFLINE", "yes"),
        ]);
        assert_eq!(c.cache_dir, PathBuf::from("/big/disk"));
        assert_eq!(c.endpoint, "https://mirror.example");
        assert_eq!(c.token.as_deref(), Some("hf_abc"));
        assert!(c.offline);
        assert!(!config(&[("HF_HUB_OFFLINE", "0")]).offline);
        let c = config(&[("HUGGINGFACE_HUB_CACHE", "/old")]);
        assert_eq!(c.cache_dir, PathBuf::from("/old"));
    }

    #[test]
    fn the_login_token_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_file\n").unwrap();
        let home = dir.path().to_str().unwrap();
        let c = config(&[("HF_HOME", home)]);
        assert_eq!(c.token.as_deref(), Some("hf_file"));
        let c = config(&[("HF_HOME", home), ("HF_TOKEN", "hf_env")]);
        assert_eq!(c.token.as_deref(), Some("hf_env"));
    }
}
