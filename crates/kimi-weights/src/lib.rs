//! Checkpoint loading for kimi-infer.
