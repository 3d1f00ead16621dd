//! Finished responses kept in memory for `previous_response_id` and `GET
//! /v1/responses/{id}`: the oldest go first once there are too many or they take too much
//! memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde_json::Value;

use crate::message::Message;

/// A kept response.
#[derive(Debug)]
pub struct StoredResponse {
    /// The response object.
    pub response: Value,
    /// The conversation after it (without instructions).
    pub conversation: Vec<Message>,
    bytes: usize,
}

/// The store.
#[derive(Debug)]
pub struct ResponseStore {
    entries: HashMap<String, Arc<StoredResponse>>,
    order: VecDeque<String>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl ResponseStore {
    /// Keeps at most `max_entries` responses of `max_bytes` in all.
    pub fn new(max_entries: usize, max_bytes: usize) -> ResponseStore {
        ResponseStore {
            entries: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_entries: max_entries.max(1),
            max_bytes,
        }
    }

    /// Keeps a response (one larger than the whole budget is not kept).
    pub fn insert(&mut self, id: String, response: Value, conversation: Vec<Message>) {
        let bytes = response.to_string().len()
            + conversation
                .iter()
                .flat_map(|m| m.text_len_parts())
                .map(str::len)
                .sum::<usize>();
        if bytes > self.max_bytes {
            tracing::warn!("response {id} ({bytes} bytes) is larger than the store; not kept");
            return;
        }
        while self.entries.len() >= self.max_entries || self.bytes + bytes > self.max_bytes {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(old) = self.entries.remove(&oldest) {
                self.bytes -= old.bytes;
            }
        }
        self.bytes += bytes;
        self.order.push_back(id.clone());
        self.entries.insert(
            id,
            Arc::new(StoredResponse {
                response,
                conversation,
                bytes,
            }),
        );
    }

    /// The response `id`.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        self.entries.get(id).cloned()
    }

    /// Forgets `id`.
    pub fn remove(&mut self, id: &str) -> Option<Arc<StoredResponse>> {
        let removed = self.entries.remove(id)?;
        self.bytes -= removed.bytes;
        self.order.retain(|k| k != id);
        Some(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn oldest_go_first() {
        let mut s = ResponseStore::new(2, 1 << 20);
        for id in ["a", "b", "c"] {
            s.insert(id.into(), json!({"id": id}), Vec::new());
        }
        assert!(s.get("a").is_none());
        assert!(s.get("b").is_some() && s.get("c").is_some());
        assert!(s.remove("b").is_some());
        assert!(s.remove("b").is_none());
        let mut small = ResponseStore::new(10, 100);
        small.insert("big".into(), json!({"x": "y".repeat(200)}), Vec::new());
        assert!(small.get("big").is_none());
    }
}
