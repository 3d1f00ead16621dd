//! API keys: `Authorization: Bearer <key>`, compared in constant time against every key.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::access_log::RequestRecord;
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

/// The index of the key `presented` matches; every key is compared, match or not.
fn matching_key(keys: &[String], presented: &[u8]) -> Option<usize> {
    keys.iter().enumerate().fold(None, |found, (i, key)| {
        let equal = constant_time_eq(key.as_bytes(), presented);
        found.or(equal.then_some(i))
    })
}

/// The index of the key in `keys` that `headers` present as `Authorization: Bearer <key>`,
/// compared in constant time against every key; `None` when none matches. Shared with
/// the agent server (`kimi-agent`), which guards its routes the same way.
pub fn presented_key(keys: &[String], headers: &axum::http::HeaderMap) -> Option<usize> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            let scheme = v.get(..7)?;
            scheme
                .eq_ignore_ascii_case(b"bearer ")
                .then(|| v[7..].trim_ascii())
        });
    presented.and_then(|key| matching_key(keys, key))
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
    match presented_key(keys, request.headers()) {
        Some(index) => {
            // The access log names the key by its position, never by its text.
            if let Some(record) = request.extensions().get::<Arc<RequestRecord>>() {
                record.key.store(index + 1, Ordering::Relaxed);
            }
            next.run(request).await
        }
        None => ApiError::unauthorized().into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        let keys = vec!["alpha".to_string(), "beta-key".to_string()];
        assert_eq!(matching_key(&keys, b"alpha"), Some(0));
        assert_eq!(matching_key(&keys, b"beta-key"), Some(1));
        assert_eq!(matching_key(&keys, b"alph"), None);
        assert_eq!(matching_key(&keys, b"alphaa"), None);
        assert_eq!(matching_key(&keys, b""), None);
        assert_eq!(matching_key(&[], b"alpha"), None);
    }
}
