//! The generation engine.
