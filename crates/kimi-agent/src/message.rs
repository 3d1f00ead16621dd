//! The conversation the loop keeps, as chat-completions messages.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id (tool messages answer it).
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as the model wrote them (JSON text, unchecked).
    pub arguments: String,
}

/// One message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    /// Instructions.
    System {
        /// Text.
        content: String,
    },
    /// The user's turn.
    User {
        /// Text.
        content: String,
    },
    /// The model's turn.
    Assistant {
        /// Text.
        content: String,
        /// Reasoning, sent back as `reasoning_content` (Kimi's interleaved thinking).
        reasoning: String,
        /// Tool calls.
        tool_calls: Vec<ToolCall>,
    },
    /// A tool's result.
    Tool {
        /// The call answered.
        call_id: String,
        /// Text.
        content: String,
    },
}

impl Message {
    /// The message as a chat-completions `messages` entry.
    pub fn to_chat(&self) -> Value {
        match self {
            Message::System { content } => json!({"role": "system", "content": content}),
            Message::User { content } => json!({"role": "user", "content": content}),
            Message::Assistant {
                content,
                reasoning,
                tool_calls,
            } => {
                let mut m = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    m["reasoning_content"] = json!(reasoning);
                }
                if !tool_calls.is_empty() {
                    m["tool_calls"] = tool_calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}})
                        })
                        .collect();
                }
                m
            }
            Message::Tool { call_id, content } => {
                json!({"role": "tool", "tool_call_id": call_id, "content": content})
            }
        }
    }

    /// The text the model reads of this message (for counting tokens).
    pub fn text_len_parts(&self) -> Vec<&str> {
        match self {
            Message::System { content }
            | Message::User { content }
            | Message::Tool { content, .. } => vec![content],
            Message::Assistant {
                content,
                reasoning,
                tool_calls,
            } => {
                let mut parts = vec![content.as_str(), reasoning.as_str()];
                for c in tool_calls {
                    parts.push(&c.name);
                    parts.push(&c.arguments);
                }
                parts
            }
        }
    }
}

/// 24 random hex digits, for item and response ids.
pub fn random_id() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..3)
        .map(|_| format!("{:08x}", rng.random::<u32>()))
        .collect()
}
