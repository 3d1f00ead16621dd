//! Incremental stop-string matching on streamed, decoded text.
//!
//! Text arrives in chunks that may cut a stop string anywhere. The matcher emits
//! everything that cannot be part of a stop string and holds back the longest tail that is
//! still a proper prefix of one:
//!
//! ```text
//! stop "STOP"     push "Hel"      push "lo ST"        push "OP and more"
//! emitted         "Hel"           "lo "               ""           stopped
//! held back       ""              "ST"                (dropped)
//! ```
//!
//! As OpenAI and vLLM do, the stop string itself and everything after it are never emitted.
//! Held-back text always starts on a char boundary, so no UTF-8 char is ever split.

/// What [`StopMatcher::push`] lets through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that may be sent to the client now.
    pub emit: String,
    /// A stop string completed; generation should end. `emit` holds the text before it.
    pub stopped: bool,
}

/// Finds stop strings in text fed to it piece by piece. One per sequence.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    /// Non-empty stop strings.
    stops: Vec<String>,
    /// Text held back because its tail could start a stop string. Never contains a whole one.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`. Empty strings are ignored (validation rejects them).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds newly decoded text. Returns what may be emitted now, holding back any tail
    /// that could be the start of a stop string, and whether a stop string completed. The
    /// earliest-starting complete stop string wins. After a stop, every push emits nothing.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.stopped {
            return StopOutput {
                emit: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        // A match cannot start in text already emitted, because that text had no tail
        // that was a prefix of a stop string; so searching `held` is enough.
        let first_stop = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.held.truncate(at);
            self.stopped = true;
            return StopOutput {
                emit: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self
            .stops
            .iter()
            .map(|stop| partial_match_len(&self.held, stop))
            .max();
        let emit_len = self.held.len() - keep.unwrap_or(0);
        let rest = self.held.split_off(emit_len);
        StopOutput {
            emit: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// End of generation: releases anything held back (nothing after a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has completed.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

/// Length in bytes of the longest proper prefix of `stop` that `text` ends with. Only
/// prefixes ending on a char boundary of `stop` count, so `text.len() - result` is a char
/// boundary of `text` (the suffix starts with the same non-continuation byte as `stop`).
fn partial_match_len(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn out(emit: &str, stopped: bool) -> StopOutput {
        StopOutput {
            emit: emit.to_string(),
            stopped,
        }
    }

    /// Feeds `chunks`, returning all emitted text (including `finish`) and whether it stopped.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = matcher(stops);
        let mut text = String::new();
        for chunk in chunks {
            text += &m.push(chunk).emit;
        }
        text += &m.finish();
        (text, m.stopped())
    }

    #[test]
    fn stop_across_chunk_boundary() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("Hel"), out("Hel", false));
        assert_eq!(m.push("lo STOP"), out("lo ", true));
        assert_eq!(m.push("more"), out("", true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn holds_back_possible_prefix_and_releases_it() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("lo ST"), out("lo ", false));
        assert_eq!(m.push("O"), out("", false));
        assert_eq!(m.push("RM"), out("STORM", false));
        assert_eq!(m.push("ST"), out("", false));
        assert_eq!(m.finish(), "ST");
    }

    #[test]
    fn stop_split_over_many_chunks() {
        assert_eq!(
            run(&["STOP"], &["a", "S", "T", "O", "P", "b"]),
            ("a".to_string(), true)
        );
        assert_eq!(run(&["STOP"], &["aSTO", "P"]), ("a".to_string(), true));
    }

    #[test]
    fn multiple_stops_earliest_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".to_string(), true)
        );
        assert_eq!(
            run(&["\n\n", "END"], &["a\n", "b END\n\n"]),
            ("a\nb ".to_string(), true)
        );
        // The longer stop's prefix is held back while the shorter one completes later.
        assert_eq!(run(&["abcd", "c"], &["ab", "c"]), ("ab".to_string(), true));
    }

    #[test]
    fn overlapping_prefixes() {
        // "aab" inside "aaab": the first held "aa" is not the start of the match.
        let chunks = ["a", "a", "a", "b", "x"];
        assert_eq!(run(&["aab"], &chunks), ("a".to_string(), true));
        let mut m = matcher(&["aab"]);
        assert_eq!(m.push("a"), out("", false));
        assert_eq!(m.push("a"), out("", false));
        assert_eq!(m.push("a"), out("a", false));
        assert_eq!(m.push("c"), out("aac", false));
        // Stops that are prefixes of each other.
        assert_eq!(run(&["ab", "abc"], &["xa", "bc"]), ("x".to_string(), true));
        assert_eq!(
            run(&["abab"], &["ab", "aab", "ab"]),
            ("aba".to_string(), true)
        );
    }

    #[test]
    fn multibyte_text_is_never_split() {
        assert_eq!(
            run(&["世界"], &["你好世", "界!"]),
            ("你好".to_string(), true)
        );
        let mut m = matcher(&["世界"]);
        assert_eq!(m.push("你好世"), out("你好", false));
        assert_eq!(m.push("人"), out("世人", false));
        // "è" and "é" share their first byte: no partial match inside a char.
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("cafè"), out("cafè", false));
        assert_eq!(m.push("é"), out("", false));
        assert_eq!(m.push("!x"), out("", true));
        assert_eq!(run(&["🙂"], &["ok 🙂 no"]), ("ok ".to_string(), true));
    }

    #[test]
    fn no_stops_passes_everything_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("anything"), out("anything", false));
        let mut m = matcher(&[""]);
        assert_eq!(
            m.push("empty stops ignored"),
            out("empty stops ignored", false)
        );
        assert_eq!(m.finish(), "");
    }
}
