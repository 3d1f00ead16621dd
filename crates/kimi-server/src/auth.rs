//! API keys: `Authorization: Bearer <key>`, compared in constant time against every key.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// Equality whose time depends only on the lengths, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

/// Whether `presented` matches one of `keys`; every key is compared, match or not.
pub(crate) fn key_matches(keys: &[String], presented: &[u8]) -> bool {
    keys.iter().fold(false, |found, key| {
        constant_time_eq(key.as_bytes(), presented) | found
    })
}

/// Rejects requests without a valid key (when keys are configured).
pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let keys = &state.inner.config.api_keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            let scheme = v.get(..7)?;
            scheme
                .eq_ignore_ascii_case(b"bearer ")
                .then(|| v[7..].trim_ascii())
        });
    match presented {
        Some(key) if key_matches(keys, key) => next.run(request).await,
        _ => ApiError::unauthorized().into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        let keys = vec!["alpha".to_string(), "beta-key".to_string()];
        assert!(key_matches(&keys, b"alpha"));
        assert!(key_matches(&keys, b"beta-key"));
        assert!(!key_matches(&keys, b"alph"));
        assert!(!key_matches(&keys, b"alphaa"));
        assert!(!key_matches(&keys, b""));
        assert!(!key_matches(&[], b"alpha"));
    }
}
