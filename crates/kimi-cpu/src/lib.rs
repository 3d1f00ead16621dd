//! The CPU backend.
