//! Context management: the conversation the model sees must fit its context window.
//!
//! The policy (also in docs/agent.md):
//!
//! 1. Tokens are counted with the model's tokenizer (`kimi-tokenizer`); for a remote
//!    endpoint without `--tokenizer`, estimated as one token per 3 bytes of UTF-8, which
//!    over-counts English BPE (about 4 bytes a token) so that the estimate errs towards
//!    fitting. Each message adds [`MESSAGE_OVERHEAD`] tokens for its chat-template markers,
//!    and the tools' JSON schemas count as their JSON text.
//! 2. Room is kept for the next answer: the per-step `max_tokens`.
//! 3. Tool outputs of one step share what is left (smaller outputs first, each keeping at
//!    least [`MIN_OUTPUT_TOKENS`]). An output over its share is cut to its head and tail
//!    with a marked elision (`[... N tokens of tool output elided ...]`), or, with the
//!    `summarize` policy, replaced by the model's summary of it (cut the same way if the
//!    summary is still too long; the head-and-tail cut is the fallback if summarising
//!    fails).
//! 4. Before each model call, if the conversation is still too long: older tool outputs
//!    are cut to [`SHRUNK_OUTPUT_TOKENS`] (oldest first); then whole older turns are dropped
//!    (oldest first: a user message, or an assistant message with its tool results).
//!    Never dropped: the system prompt, the latest user turn, the latest assistant turn
//!    and its tool results. If that is still too long the response ends `incomplete` with
//!    reason `context_length`, saying how many tokens were needed.

use std::sync::Arc;

use kimi_tokenizer::Tokenizer;
use serde_json::Value;

use crate::message::Message;

/// Tokens each message costs beyond its text (role markers of the chat template).
pub const MESSAGE_OVERHEAD: usize = 8;
/// The least a tool output is cut to when the context is short.
pub const MIN_OUTPUT_TOKENS: usize = 64;
/// What older tool outputs are cut to when the conversation must shrink.
pub const SHRUNK_OUTPUT_TOKENS: usize = 48;
/// Bytes per token of the estimate.
const ESTIMATE_BYTES_PER_TOKEN: usize = 3;

/// How tokens are counted.
#[derive(Clone)]
pub enum TokenCounter {
    /// The model's own tokenizer.
    Tokenizer(Arc<Tokenizer>),
    /// One token per 3 bytes.
    Estimate,
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenCounter::Tokenizer(_) => "TokenCounter::Tokenizer",
            TokenCounter::Estimate => "TokenCounter::Estimate",
        })
    }
}

impl TokenCounter {
    /// Tokens of `text`.
    pub fn count(&self, text: &str) -> usize {
        match self {
            TokenCounter::Tokenizer(t) => match t.encode(text, false) {
                Ok(ids) => ids.len(),
                Err(_) => estimate(text),
            },
            TokenCounter::Estimate => estimate(text),
        }
    }

    /// The first and last tokens of `text`, `keep` in all, and how many were left out.
    fn head_tail(&self, text: &str, keep: usize) -> (String, String, usize) {
        if let TokenCounter::Tokenizer(t) = self {
            if let Ok(ids) = t.encode(text, false) {
                if ids.len() <= keep {
                    return (text.to_string(), String::new(), 0);
                }
                let head_n = keep.div_ceil(2);
                let tail_n = keep - head_n;
                let head = t.decode(&ids[..head_n], false);
                let tail = t.decode(&ids[ids.len() - tail_n..], false);
                if let (Ok(head), Ok(tail)) = (head, tail) {
                    return (head, tail, ids.len() - keep);
                }
            }
        }
        let bytes = text.as_bytes();
        let keep_bytes = keep * ESTIMATE_BYTES_PER_TOKEN;
        if bytes.len() <= keep_bytes {
            return (text.to_string(), String::new(), 0);
        }
        let head_bytes = keep_bytes.div_ceil(2);
        let head = crate::sandbox::trim_partial_end(&bytes[..head_bytes]);
        let tail =
            crate::sandbox::trim_partial_start(&bytes[bytes.len() - (keep_bytes - head_bytes)..]);
        let elided = estimate(text).saturating_sub(keep);
        (
            String::from_utf8_lossy(head).into_owned(),
            String::from_utf8_lossy(tail).into_owned(),
            elided,
        )
    }
}

fn estimate(text: &str) -> usize {
    text.len().div_ceil(ESTIMATE_BYTES_PER_TOKEN)
}

/// What happens to a tool output that does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverflowPolicy {
    /// Keep its head and tail with a marked elision.
    Truncate,
    /// Replace it by the model's summary.
    Summarize,
}

impl std::str::FromStr for OverflowPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "truncate" => Ok(OverflowPolicy::Truncate),
            "summarize" | "summarise" => Ok(OverflowPolicy::Summarize),
            _ => Err(format!("`{s}`: expected truncate or summarize")),
        }
    }
}

/// The window and how to keep within it.
#[derive(Debug, Clone)]
pub struct ContextManager {
    /// The model's context length, tokens.
    pub window: usize,
    /// How tokens are counted.
    pub counter: TokenCounter,
    /// What to do with a tool output that does not fit.
    pub policy: OverflowPolicy,
}

/// The conversation cannot be made to fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the conversation needs {needed} tokens (with room for the answer) and the context window \
     is {window}, even with older turns and tool outputs removed"
)]
pub struct ContextExceeded {
    /// Tokens needed.
    pub needed: usize,
    /// The window.
    pub window: usize,
}

impl ContextManager {
    /// Tokens of one message.
    pub fn message_tokens(&self, m: &Message) -> usize {
        MESSAGE_OVERHEAD
            + m.text_len_parts()
                .iter()
                .map(|p| self.counter.count(p))
                .sum::<usize>()
    }

    /// Tokens of a conversation.
    pub fn conversation_tokens(&self, messages: &[Message]) -> usize {
        messages.iter().map(|m| self.message_tokens(m)).sum()
    }

    /// Tokens of the tools' specs.
    pub fn tools_tokens(&self, specs: &[Value]) -> usize {
        specs
            .iter()
            .map(|s| self.counter.count(&s.to_string()))
            .sum()
    }

    /// Each output's share of `available` tokens: smaller outputs take what they need,
    /// the rest split what remains; none gets less than [`MIN_OUTPUT_TOKENS`].
    pub fn output_budgets(&self, available: usize, sizes: &[usize]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| sizes[i]);
        let mut budgets = vec![0; sizes.len()];
        let mut left = available;
        for (k, &i) in order.iter().enumerate() {
            let share = left / (sizes.len() - k);
            let budget = sizes[i].min(share).max(MIN_OUTPUT_TOKENS.min(sizes[i]));
            budgets[i] = budget;
            left = left.saturating_sub(budget);
        }
        budgets
    }

    /// `text` cut to about `budget` tokens: head and tail with a marked elision. Returns
    /// the text and the tokens left out (0: unchanged).
    pub fn truncate(&self, text: &str, budget: usize) -> (String, usize) {
        let total = self.counter.count(text);
        if total <= budget {
            return (text.to_string(), 0);
        }
        // The marker costs tokens too.
        let keep = budget.saturating_sub(24).max(16);
        let (head, tail, elided) = self.counter.head_tail(text, keep);
        if elided == 0 {
            return (text.to_string(), 0);
        }
        (
            format!(
                "{head}\n[... {elided} tokens of tool output elided to fit the context window \
                 ...]\n{tail}"
            ),
            elided,
        )
    }

    /// Shrinks `messages` until they and `fixed` more tokens fit the window (see the module
    /// docs for the order). Returns what was done, in words, for the log.
    ///
    /// # Errors
    ///
    /// [`ContextExceeded`] when even the protected messages do not fit.
    pub fn fit(
        &self,
        messages: &mut Vec<Message>,
        fixed: usize,
    ) -> Result<Vec<String>, ContextExceeded> {
        let mut notes = Vec::new();
        let mut total = self.conversation_tokens(messages) + fixed;
        if total <= self.window {
            return Ok(notes);
        }
        // The last unit (the latest assistant turn and its tool results) is kept whole.
        let last_assistant = messages
            .iter()
            .rposition(|m| matches!(m, Message::Assistant { .. }));
        let protected_from = last_assistant.unwrap_or(messages.len());
        // 1. Older tool outputs cut short, oldest first.
        for message in messages.iter_mut().take(protected_from) {
            if total <= self.window {
                break;
            }
            if let Message::Tool { content, .. } = message {
                let before = MESSAGE_OVERHEAD + self.counter.count(content);
                let (cut, elided) = self.truncate(content, SHRUNK_OUTPUT_TOKENS);
                if elided > 0 {
                    *content = cut;
                    let after = MESSAGE_OVERHEAD + self.counter.count(content);
                    total = total.saturating_sub(before.saturating_sub(after));
                    notes.push(format!("an older tool output was cut by {elided} tokens"));
                }
            }
        }
        // 2. Whole older turns dropped, oldest first.
        let mut dropped = 0usize;
        loop {
            if total <= self.window {
                break;
            }
            let last_user = messages
                .iter()
                .rposition(|m| matches!(m, Message::User { .. }));
            let last_assistant = messages
                .iter()
                .rposition(|m| matches!(m, Message::Assistant { .. }));
            let Some(start) = messages
                .iter()
                .position(|m| !matches!(m, Message::System { .. }))
            else {
                break;
            };
            let unit_end = match &messages[start] {
                Message::User { .. } if Some(start) != last_user => start + 1,
                Message::Assistant { .. } if Some(start) != last_assistant => {
                    let mut end = start + 1;
                    while matches!(messages.get(end), Some(Message::Tool { .. })) {
                        end += 1;
                    }
                    end
                }
                // An orphan tool result (its call was dropped before).
                Message::Tool { .. } => start + 1,
                // The latest user turn: drop the first assistant unit after it, if it is
                // not the latest one.
                Message::User { .. } => {
                    let Some(next) = (start + 1..messages.len())
                        .find(|&i| matches!(messages[i], Message::Assistant { .. }))
                    else {
                        break;
                    };
                    if Some(next) == last_assistant {
                        break;
                    }
                    let mut end = next + 1;
                    while matches!(messages.get(end), Some(Message::Tool { .. })) {
                        end += 1;
                    }
                    let removed: usize = messages
                        .drain(next..end)
                        .map(|m| self.message_tokens(&m))
                        .sum();
                    total = total.saturating_sub(removed);
                    dropped += end - next;
                    continue;
                }
                _ => break,
            };
            let removed: usize = messages
                .drain(start..unit_end)
                .map(|m| self.message_tokens(&m))
                .sum();
            total = total.saturating_sub(removed);
            dropped += unit_end - start;
        }
        if dropped > 0 {
            notes.push(format!("{dropped} older messages were dropped"));
        }
        if total > self.window {
            return Err(ContextExceeded {
                needed: total,
                window: self.window,
            });
        }
        Ok(notes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ToolCall;

    fn cm(window: usize) -> ContextManager {
        ContextManager {
            window,
            counter: TokenCounter::Estimate,
            policy: OverflowPolicy::Truncate,
        }
    }

    fn assistant_call(id: &str) -> Message {
        Message::Assistant {
            content: String::new(),
            reasoning: String::new(),
            tool_calls: vec![ToolCall {
                id: id.into(),
                name: "t".into(),
                arguments: "{}".into(),
            }],
        }
    }

    #[test]
    fn truncation_keeps_head_and_tail() {
        let c = cm(1000);
        let text: String = (0..3000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let (cut, elided) = c.truncate(&text, 100);
        assert!(elided > 0);
        assert!(cut.starts_with("abc") && cut.ends_with(&text[text.len() - 10..]));
        assert!(cut.contains("tokens of tool output elided"));
        assert!(
            c.counter.count(&cut) <= 100 + 30,
            "{}",
            c.counter.count(&cut)
        );
        assert_eq!(c.truncate("short", 100), ("short".to_string(), 0));
    }

    #[test]
    fn budgets_favour_small_outputs() {
        let c = cm(1000);
        assert_eq!(c.output_budgets(1000, &[100, 5000]), vec![100, 900]);
        assert_eq!(c.output_budgets(10, &[500, 500]), vec![64, 64]);
        assert_eq!(c.output_budgets(10, &[5]), vec![5]);
    }

    #[test]
    fn system_prompt_and_latest_turns_survive() {
        let big = "x".repeat(3000);
        let mut messages = vec![
            Message::System {
                content: "sys".into(),
            },
            Message::User {
                content: big.clone(),
            },
            assistant_call("a"),
            Message::Tool {
                call_id: "a".into(),
                content: big.clone(),
            },
            Message::User {
                content: "latest".into(),
            },
            assistant_call("b"),
            Message::Tool {
                call_id: "b".into(),
                content: "small".into(),
            },
        ];
        let notes = cm(200).fit(&mut messages, 50).unwrap();
        assert!(!notes.is_empty());
        assert_eq!(
            messages[0],
            Message::System {
                content: "sys".into()
            }
        );
        assert!(messages.contains(&Message::User {
            content: "latest".into()
        }));
        assert_eq!(
            messages.last(),
            Some(&Message::Tool {
                call_id: "b".into(),
                content: "small".into()
            })
        );
        // Nothing left to drop: an error, not a silent loss.
        let mut messages = vec![
            Message::System {
                content: big.clone(),
            },
            Message::User {
                content: "q".into(),
            },
        ];
        let err = cm(200).fit(&mut messages, 50).unwrap_err();
        assert_eq!(err.window, 200);
        assert_eq!(messages.len(), 2);
    }
}
