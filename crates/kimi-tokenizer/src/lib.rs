//! Tokenizers and chat templates for kimi-infer.
