//! HTTP clients (reqwest on rustls with the `ring` provider) and bounded body reads.

use std::time::Duration;

use futures_util::StreamExt;

/// Installs rustls's `ring` provider as the process default, once; every client of this
/// crate (and rmcp's) finds it there.
pub fn init_tls() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // ring rather than aws-lc-rs: no C build beyond ring's own (which also cross-builds
        // for aarch64 with a plain cross gcc). rustls deprecates it only for lacking
        // post-quantum key exchange.
        // Err: another part of the process installed one first, which serves as well.
        #[allow(deprecated)]
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A client builder with the TLS provider in place and a connect timeout.
pub fn client_builder() -> reqwest::ClientBuilder {
    init_tls();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .user_agent(concat!("kimi-agent/", env!("CARGO_PKG_VERSION")))
}

/// A body read up to a limit.
#[derive(Debug)]
pub struct CappedBody {
    /// The bytes read (at most the limit).
    pub bytes: Vec<u8>,
    /// Whether the body went on past the limit (the rest was not read).
    pub truncated: bool,
}

/// Reads `response`'s body, stopping after `cap` bytes.
///
/// # Errors
///
/// The transport error that cut the body short.
pub async fn read_capped(
    response: reqwest::Response,
    cap: usize,
) -> Result<CappedBody, reqwest::Error> {
    let mut bytes = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        let room = cap - bytes.len();
        if chunk.len() > room {
            bytes.extend_from_slice(&chunk[..room]);
            return Ok(CappedBody {
                bytes,
                truncated: true,
            });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(CappedBody {
        bytes,
        truncated: false,
    })
}

/// A body as text for the model: UTF-8 (invalid bytes replaced and said), cut at a
/// character boundary, with a note when it was truncated.
pub fn body_text(body: &CappedBody, cap: usize) -> String {
    let bytes = if body.truncated {
        crate::sandbox::trim_partial_end(&body.bytes)
    } else {
        &body.bytes[..]
    };
    let mut text = match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        Err(_) => format!(
            "{}\n[the response was not valid UTF-8: invalid bytes are shown as U+FFFD]",
            String::from_utf8_lossy(bytes)
        ),
    };
    if body.truncated {
        text.push_str(&format!(
            "\n[... the response was longer than {cap} bytes and was cut here ...]"
        ));
    }
    text
}

/// A reqwest error in plain words (with its causes, which reqwest keeps apart).
pub fn describe_error(e: &reqwest::Error) -> String {
    let mut text = if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_connect() {
        "could not connect".to_string()
    } else {
        e.to_string()
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
