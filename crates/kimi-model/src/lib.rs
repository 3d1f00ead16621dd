//! Kimi model definitions.
