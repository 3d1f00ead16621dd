//! `--include`/`--exclude` patterns, matched as `huggingface_hub`'s `allow_patterns` and
//! `ignore_patterns` are (Python's `fnmatch`): `*` matches any run of characters, `/`
//! included, `?` one character, `[abc]`/`[!abc]`/`[a-z]` a set; a pattern ending in `/`
//! matches everything under that folder.

/// Which files a download takes: those matching an include pattern (all when there are
/// none) and no exclude pattern.
#[derive(Clone, Debug, Default)]
pub struct FileFilter {
    include: Vec<String>,
    exclude: Vec<String>,
}

impl FileFilter {
    /// A filter from `--include` and `--exclude` patterns.
    pub fn new(include: &[String], exclude: &[String]) -> Self {
        let folder = |p: &String| {
            if p.ends_with('/') {
                format!("{p}*")
            } else {
                p.clone()
            }
        };
        Self {
            include: include.iter().map(folder).collect(),
            exclude: exclude.iter().map(folder).collect(),
        }
    }

    /// True when `path` is to be downloaded.
    pub fn accepts(&self, path: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|p| fnmatch(p, path)))
            && !self.exclude.iter().any(|p| fnmatch(p, path))
    }

    /// True when neither list has a pattern.
    pub fn is_empty(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }

    /// The patterns, for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.include.is_empty() {
            parts.push(format!("include {}", self.include.join(", ")));
        }
        if !self.exclude.is_empty() {
            parts.push(format!("exclude {}", self.exclude.join(", ")));
        }
        parts.join("; ")
    }
}

/// Python's `fnmatch.fnmatchcase(name, pattern)`.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative matching with one backtrack point for the last `*` seen: linear in
    // practice, never exponential.
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() {
            match p[pi] {
                '*' => {
                    star = Some((pi, ni));
                    pi += 1;
                    continue;
                }
                '?' => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                '[' => {
                    if let Some((matched, next)) = match_set(&p, pi, n[ni]) {
                        if matched {
                            pi = next;
                            ni += 1;
                            continue;
                        }
                    } else if n[ni] == '[' {
                        // An unclosed `[` is a literal, as in Python.
                        pi += 1;
                        ni += 1;
                        continue;
                    }
                }
                c if c == n[ni] => {
                    pi += 1;
                    ni += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, sn)) => {
                pi = sp + 1;
                ni = sn + 1;
                star = Some((sp, sn + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Matches `c` against the set starting at `p[start] == '['`: `Some((matched, index after
/// the set))`, or `None` when the set is not closed.
fn match_set(p: &[char], start: usize, c: char) -> Option<(bool, usize)> {
    let mut i = start + 1;
    let negate = p.get(i) == Some(&'!');
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        let here = *p.get(i)?;
        if here == ']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        if p.get(i + 1) == Some(&'-') && p.get(i + 2).is_some_and(|&e| e != ']') {
            let end = p[i + 2];
            matched |= here <= c && c <= end;
            i += 3;
        } else {
            matched |= here == c;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_pythons_fnmatch() {
        assert!(fnmatch("*.safetensors", "model-00001-of-00002.safetensors"));
        assert!(fnmatch("*.safetensors", "sub/dir/x.safetensors"));
        assert!(!fnmatch("*.safetensors", "model.safetensors.index.json"));
        assert!(fnmatch("*Q4_K_M*", "gguf/model-Q4_K_M.gguf"));
        assert!(fnmatch("config.json", "config.json"));
        assert!(!fnmatch("config.json", "sub/config.json"));
        assert!(fnmatch("model-0000?-of-*", "model-00003-of-00009.bin"));
        assert!(fnmatch("[ab]*", "b.txt"));
        assert!(!fnmatch("[!ab]*", "b.txt"));
        assert!(fnmatch("x[0-9].bin", "x7.bin"));
        assert!(fnmatch("[]]", "]"));
        assert!(fnmatch("a[", "a["));
        assert!(fnmatch("*", ""));
        assert!(!fnmatch("?", ""));
        assert!(fnmatch("*a*b*c*", "xxaxxbxxcxx"));
        assert!(!fnmatch("*a*b*c*d", &"abc".repeat(1000)));
    }

    #[test]
    fn filters_combine_include_and_exclude() {
        let f = FileFilter::new(&["*.json".into(), "tok/".into()], &["*index*".into()]);
        assert!(f.accepts("config.json"));
        assert!(f.accepts("tok/tiktoken.model"));
        assert!(!f.accepts("model.safetensors.index.json"));
        assert!(!f.accepts("model.safetensors"));
        assert!(FileFilter::new(&[], &[]).accepts("anything"));
        assert!(!FileFilter::new(&[], &["*.bin".into()]).accepts("a.bin"));
    }
}
