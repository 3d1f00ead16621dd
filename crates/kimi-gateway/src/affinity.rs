//! Session and prefix affinity: the same conversation goes back to the upstream that served
//! it, where its prefix is likely still cached.
//!
//! A request becomes a chain of hashes, each covering everything before it: for a chat,
//! one per message (seeded with the model and tools); for a text prompt, one per 256 bytes
//! (or 64 token ids). After routing, every link of the chain maps to the upstream chosen;
//! the next turn of a conversation repeats the earlier messages, so its chain starts with
//! the same links, and the longest link found picks its upstream. A client can name the
//! conversation instead with an `x-session-id` header. The table is learned from the
//! gateway's own choices, so it works with any OpenAI-compatible upstream.
//!
//! The table keeps at most `capacity` links in two generations: when the young one fills,
//! the old one is dropped (an approximate LRU with O(1) work per link).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Mutex, PoisonError};

use serde_json::Value;

/// Bytes of a text prompt per link.
const TEXT_BLOCK: usize = 256;
/// Token ids of a tokenized prompt per link.
const TOKEN_BLOCK: usize = 64;
/// Links looked at per request (the longest conversations keep their last ones).
const MAX_LINKS: usize = 512;

/// A request's links, shortest prefix first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Chain(pub Vec<u64>);

fn hash_of(prev: u64, part: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    prev.hash(&mut h);
    part.hash(&mut h);
    h.finish()
}

impl Chain {
    /// The chain of a request to `path` with JSON `body`, or of its `session` header.
    pub fn of(path: &str, body: &Value, session: Option<&str>) -> Chain {
        if let Some(session) = session {
            return Chain(vec![hash_of(1, session.as_bytes())]);
        }
        let model = body.get("model").and_then(Value::as_str).unwrap_or("");
        let mut links = Vec::new();
        if path.ends_with("/chat/completions") {
            let Some(messages) = body.get("messages").and_then(Value::as_array) else {
                return Chain::default();
            };
            let tools = body.get("tools").map(Value::to_string).unwrap_or_default();
            let mut h = hash_of(hash_of(2, model.as_bytes()), tools.as_bytes());
            for message in messages {
                h = hash_of(h, message.to_string().as_bytes());
                links.push(h);
            }
        } else {
            let mut h = hash_of(3, model.as_bytes());
            match body.get("prompt") {
                Some(Value::String(text)) => {
                    for block in text.as_bytes().chunks_exact(TEXT_BLOCK) {
                        h = hash_of(h, block);
                        links.push(h);
                    }
                }
                Some(Value::Array(ids)) if ids.first().is_some_and(Value::is_u64) => {
                    let ids: Vec<u8> = ids
                        .iter()
                        .flat_map(|id| id.as_u64().unwrap_or(0).to_le_bytes())
                        .collect();
                    for block in ids.chunks_exact(TOKEN_BLOCK * 8) {
                        h = hash_of(h, block);
                        links.push(h);
                    }
                }
                _ => {}
            }
        }
        if links.len() > MAX_LINKS {
            links.drain(..links.len() - MAX_LINKS);
        }
        Chain(links)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Default)]
struct Generations {
    young: HashMap<u64, usize>,
    old: HashMap<u64, usize>,
}

/// Links → upstream index.
pub(crate) struct AffinityTable {
    generations: Mutex<Generations>,
    capacity: usize,
}

impl AffinityTable {
    pub fn new(capacity: usize) -> AffinityTable {
        AffinityTable {
            generations: Mutex::new(Generations::default()),
            capacity: capacity.max(2),
        }
    }

    /// The upstream of the longest link of `chain` that is known.
    pub fn lookup(&self, chain: &Chain) -> Option<usize> {
        let g = self
            .generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        chain
            .0
            .iter()
            .rev()
            .find_map(|link| g.young.get(link).or_else(|| g.old.get(link)).copied())
    }

    /// Maps every link of `chain` to `upstream`.
    pub fn record(&self, chain: &Chain, upstream: usize) {
        let mut g = self
            .generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for &link in &chain.0 {
            if g.young.len() >= self.capacity / 2 {
                g.old = std::mem::take(&mut g.young);
            }
            g.young.insert(link, upstream);
        }
    }

    /// Links remembered.
    pub fn len(&self) -> usize {
        let g = self
            .generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        g.young.len() + g.old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_conversation_finds_its_upstream_again() {
        let table = AffinityTable::new(100);
        let turn1 = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"}]});
        let turn2 = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "how are you?"}]});
        let other = json!({"model": "m", "messages": [
            {"role": "system", "content": "be verbose"},
            {"role": "user", "content": "hi"}]});
        let path = "/v1/chat/completions";
        let (c1, c2, c3) = (
            Chain::of(path, &turn1, None),
            Chain::of(path, &turn2, None),
            Chain::of(path, &other, None),
        );
        assert_eq!(c2.0[..2], c1.0[..]);
        assert_eq!(table.lookup(&c2), None);
        table.record(&c1, 1);
        assert_eq!(table.lookup(&c2), Some(1));
        assert_eq!(table.lookup(&c3), None);
    }

    #[test]
    fn prompts_link_by_blocks_and_sessions_by_name() {
        let long = "x".repeat(600);
        let chain = Chain::of("/v1/completions", &json!({"prompt": long}), None);
        assert_eq!(chain.0.len(), 2);
        let short = Chain::of("/v1/completions", &json!({"prompt": "hi"}), None);
        assert!(short.is_empty());
        let ids: Vec<u32> = (0..130).collect();
        assert_eq!(
            Chain::of("/v1/completions", &json!({"prompt": ids}), None)
                .0
                .len(),
            2
        );
        let a = Chain::of("/v1/completions", &json!({}), Some("s1"));
        let b = Chain::of("/v1/chat/completions", &json!({"messages": []}), Some("s1"));
        assert_eq!(a, b);
    }

    #[test]
    fn the_table_stays_bounded() {
        let table = AffinityTable::new(10);
        for i in 0..100 {
            table.record(&Chain(vec![i]), 0);
        }
        assert!(table.len() <= 10);
        assert_eq!(table.lookup(&Chain(vec![99])), Some(0));
    }
}
