//! Names: repository ids, revisions, `org/name[@revision]` references and file paths in a
//! repository, validated as the hub validates them, so that nothing a user or a hostile
//! listing writes can reach outside the cache.

use std::fmt;
use std::path::PathBuf;

use crate::HubError;

/// The branch a repository is downloaded from unless a revision is given.
pub const DEFAULT_REVISION: &str = "main";

/// A model repository on the hub: `org/name` (or a legacy bare `name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RepoId(String);

impl RepoId {
    /// Validates `id` as `huggingface_hub` does: one or two names of letters, digits, `-`,
    /// `_` and `.`, separated by `/`, at most 96 characters, no `--` or `..`, not starting or
    /// ending with `-` or `.`.
    pub fn parse(id: &str) -> Result<Self, HubError> {
        let bad = |why| HubError::BadRepoId {
            id: id.to_string(),
            why,
        };
        if id.is_empty() || id.len() > 96 {
            return Err(bad("it must have 1 to 96 characters"));
        }
        if id.contains("--") || id.contains("..") {
            return Err(bad("`--` and `..` are not allowed"));
        }
        let parts: Vec<&str> = id.split('/').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(bad("a name is empty"));
        }
        if parts.len() > 2 {
            return Err(bad("it has more than one `/`"));
        }
        for part in &parts {
            if !part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            {
                return Err(bad(
                    "it has a character other than letters, digits, `-`, `_`, `.`",
                ));
            }
            if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
                return Err(bad("a name starts or ends with `-` or `.`"));
            }
        }
        Ok(Self(id.to_string()))
    }

    /// The id as the hub spells it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The repository's folder in the cache: `models--org--name`.
    pub fn cache_folder_name(&self) -> String {
        format!("models--{}", self.0.replace('/', "--"))
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a revision name before it becomes a path under `refs/` or part of a URL.
pub fn validate_revision(revision: &str) -> Result<(), HubError> {
    let ok = !revision.is_empty()
        && revision.len() <= 256
        && !revision.starts_with('/')
        && revision
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
        && !revision.chars().any(|c| c.is_control() || c == '\\');
    if ok {
        Ok(())
    } else {
        Err(HubError::BadRevision {
            revision: revision.to_string(),
        })
    }
}

/// True for a full commit hash (40 lowercase hex digits), which needs no `refs/` entry.
pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40
        && revision
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A model named on the command line: `org/name`, `org/name@revision`, optionally followed
/// by a file in the repository (`org/name/model-Q4_K_M.gguf`, `org/name@v1/sub/file.gguf`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRef {
    pub repo: RepoId,
    pub revision: String,
    /// A file inside the snapshot (`/`-separated), if one was named.
    pub file: Option<String>,
}

impl ModelRef {
    /// Parses `org/name[@revision][/path/in/repo]`; `None` when `text` does not have that
    /// shape (so that a caller can say "no such file" for what was meant as a path).
    /// A bare `name` is not taken as a repository here: on a command line it is far more
    /// often a mistyped local path.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.splitn(3, '/');
        let org = parts.next()?;
        let name_rev = parts.next()?;
        let rest = parts.next();
        let (name, revision) = match name_rev.split_once('@') {
            Some((name, rev)) => (name, rev.to_string()),
            None => (name_rev, DEFAULT_REVISION.to_string()),
        };
        let repo = RepoId::parse(&format!("{org}/{name}")).ok()?;
        // A revision like `refs/pr/1` cannot be told from a file path here; branches and
        // tags without `/` and commits can.
        validate_revision(&revision).ok()?;
        let file = match rest {
            Some(path) => Some(safe_relative_path(&repo, path).ok()?.1),
            None => None,
        };
        Some(Self {
            repo,
            revision,
            file,
        })
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.repo)?;
        if self.revision != DEFAULT_REVISION {
            write!(f, "@{}", self.revision)?;
        }
        if let Some(file) = &self.file {
            write!(f, "/{file}")?;
        }
        Ok(())
    }
}

/// Checks a file name from the hub (or a user) and returns it as a relative path plus its
/// `/`-separated form: no absolute paths, no `.` or `..` components, no empty components,
/// no backslashes or control characters.
pub fn safe_relative_path(repo: &RepoId, file: &str) -> Result<(PathBuf, String), HubError> {
    let unsafe_path = || HubError::UnsafePath {
        repo: repo.to_string(),
        file: file.to_string(),
    };
    if file.is_empty() || file.len() > 4096 || file.starts_with('/') {
        return Err(unsafe_path());
    }
    if file.chars().any(|c| c.is_control() || c == '\\') {
        return Err(unsafe_path());
    }
    let mut path = PathBuf::new();
    for component in file.split('/') {
        if component.is_empty() || component == "." || component == ".." {
            return Err(unsafe_path());
        }
        path.push(component);
    }
    Ok((path, file.to_string()))
}

/// Percent-encodes `text` as Python's `urllib.parse.quote` does (letters, digits, `_.-~`
/// and the characters of `safe` stay), which is how `huggingface_hub` builds its URLs.
pub fn quote(text: &str, safe: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if b.is_ascii_alphanumeric() || b"_.-~".contains(&b) || safe.as_bytes().contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_checked_as_the_hub_checks_them() {
        assert_eq!(
            RepoId::parse("moonshotai/Kimi-K2-Instruct")
                .unwrap()
                .cache_folder_name(),
            "models--moonshotai--Kimi-K2-Instruct"
        );
        assert!(RepoId::parse("gpt2").is_ok());
        for bad in [
            "", "a/b/c", "a//b", "/a", "a--b/c", "a/b..c", "-a/b", "a/b.", "a/b c", "a/ü",
        ] {
            assert!(RepoId::parse(bad).is_err(), "{bad}");
        }
        assert!(RepoId::parse(&"x".repeat(97)).is_err());
    }

    #[test]
    fn model_refs_carry_revision_and_file() {
        let r = ModelRef::parse("org/name").unwrap();
        assert_eq!((r.repo.as_str(), r.revision.as_str()), ("org/name", "main"));
        assert_eq!(r.file, None);
        let r = ModelRef::parse("org/name@v1.0/sub/model.gguf").unwrap();
        assert_eq!(r.revision, "v1.0");
        assert_eq!(r.file.as_deref(), Some("sub/model.gguf"));
        assert_eq!(r.to_string(), "org/name@v1.0/sub/model.gguf");
        assert_eq!(ModelRef::parse("model.gguf"), None);
        assert_eq!(ModelRef::parse("./models/x"), None);
        assert_eq!(ModelRef::parse("/abs/path"), None);
        assert_eq!(ModelRef::parse("org/name/../../etc"), None);
        assert_eq!(ModelRef::parse("org/name@"), None);
    }

    #[test]
    fn hostile_file_names_are_refused() {
        let repo = RepoId::parse("a/b").unwrap();
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a//b",
            "./a",
            "a\\b",
            "a\0b",
            "",
        ] {
            assert!(safe_relative_path(&repo, bad).is_err(), "{bad:?}");
        }
        let (path, name) = safe_relative_path(&repo, "sub/dir/model.safetensors").unwrap();
        assert_eq!(path, PathBuf::from("sub/dir/model.safetensors"));
        assert_eq!(name, "sub/dir/model.safetensors");
    }

    #[test]
    fn revisions_and_urls() {
        assert!(validate_revision("main").is_ok());
        assert!(validate_revision("refs/pr/1").is_ok());
        for bad in ["", "/x", "a/../b", "..", "a\nb"] {
            assert!(validate_revision(bad).is_err(), "{bad:?}");
        }
        assert!(is_commit_hash(&"a1".repeat(20)));
        assert!(!is_commit_hash("main"));
        assert_eq!(quote("refs/pr/1", ""), "refs%2Fpr%2F1");
        assert_eq!(quote("sub dir/a+b.bin", "/"), "sub%20dir/a%2Bb.bin");
    }
}
