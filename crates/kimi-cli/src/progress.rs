//! Progress bars on stderr, drawn only when it is a terminal: logs and CI get none.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `total` bytes labelled `what`, or `None` when stderr is not a terminal.
pub fn bytes_bar(total: u64, what: &str) -> Option<ProgressBar> {
    bar(
        total,
        what,
        "{msg} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
}

/// The style of a bar of bytes (for bars made elsewhere, such as a download's per-file bars).
pub fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template("{msg} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// A bar of `total` items labelled `what`, or `None` when stderr is not a terminal.
pub fn count_bar(total: u64, what: &str) -> Option<ProgressBar> {
    bar(total, what, "{prefix} [{bar:32}] {pos}/{len} {msg}")
}

/// A spinner for work of unknown length (GGUF loading reads tensors in the model code).
pub fn spinner(what: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!("{what}…"));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    Some(spinner)
}

fn bar(total: u64, what: &str, template: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let style = ProgressStyle::with_template(template)
        .ok()?
        .progress_chars("=> ");
    let bar = ProgressBar::new(total).with_style(style);
    bar.set_message(what.to_string());
    bar.set_prefix(what.to_string());
    Some(bar)
}

/// Shows the loading of `ckpt`'s tensors as a bar of bytes (nothing when not a terminal);
/// the returned bar is finished and cleared by the caller once the model is loaded.
pub fn watch_checkpoint(ckpt: &mut kimi_weights::Checkpoint) -> Option<ProgressBar> {
    let bar = bytes_bar(ckpt.total_bytes(), "loading weights")?;
    let counter = bar.clone();
    ckpt.set_read_observer(Arc::new(move |bytes| counter.inc(bytes)));
    Some(bar)
}
