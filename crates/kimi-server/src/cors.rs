//! CORS for browsers on other origins, with vLLM's options (`--allowed-origins`,
//! `--allowed-methods`, `--allowed-headers`, `--allow-credentials`). Off unless origins are
//! given: the server's own web page is same-origin and needs none.

use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer, ExposeHeaders};

/// CORS settings; `"*"` in a list means any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorsConfig {
    /// Origins allowed to call the API (`https://app.example.com`, or `*`).
    pub allowed_origins: Vec<String>,
    /// Methods allowed in cross-origin requests (`*`: any).
    pub allowed_methods: Vec<String>,
    /// Request headers allowed in cross-origin requests (`*`: any).
    pub allowed_headers: Vec<String>,
    /// Whether browsers may send credentials (cookies, HTTP auth). With a `*` list the
    /// request's own origin, method or headers are echoed instead, as the CORS rules
    /// require.
    pub allow_credentials: bool,
}

impl Default for CorsConfig {
    /// vLLM's defaults: any origin, method and header, no credentials.
    fn default() -> Self {
        let any = vec!["*".to_string()];
        CorsConfig {
            allowed_origins: any.clone(),
            allowed_methods: any.clone(),
            allowed_headers: any,
            allow_credentials: false,
        }
    }
}

/// Response headers a browser script may read: the request id, the cache and upstream
/// headers of the gateway, and the retry delay of a 429.
const EXPOSED: &[&str] = &[
    "x-request-id",
    "x-kimi-cache",
    "x-kimi-upstream",
    "retry-after",
];

fn is_any(list: &[String]) -> bool {
    list.iter().any(|item| item.trim() == "*")
}

impl CorsConfig {
    /// The tower-http layer.
    ///
    /// # Errors
    ///
    /// A message naming the flag and the value that is not a valid origin, method or header.
    pub fn layer(&self) -> Result<CorsLayer, String> {
        let credentials = self.allow_credentials;
        let origins = if is_any(&self.allowed_origins) {
            if credentials {
                AllowOrigin::mirror_request()
            } else {
                AllowOrigin::any()
            }
        } else {
            let values = self
                .allowed_origins
                .iter()
                .map(|o| {
                    HeaderValue::from_str(o.trim().trim_end_matches('/'))
                        .map_err(|_| format!("--allowed-origins: `{o}` is not an origin"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            AllowOrigin::list(values)
        };
        let methods = if is_any(&self.allowed_methods) {
            if credentials {
                AllowMethods::mirror_request()
            } else {
                AllowMethods::any()
            }
        } else {
            let values = self
                .allowed_methods
                .iter()
                .map(|m| {
                    Method::from_bytes(m.trim().to_ascii_uppercase().as_bytes())
                        .map_err(|_| format!("--allowed-methods: `{m}` is not an HTTP method"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            AllowMethods::list(values)
        };
        let headers = if is_any(&self.allowed_headers) {
            if credentials {
                AllowHeaders::mirror_request()
            } else {
                AllowHeaders::any()
            }
        } else {
            let values = self
                .allowed_headers
                .iter()
                .map(|h| {
                    HeaderName::from_bytes(h.trim().as_bytes())
                        .map_err(|_| format!("--allowed-headers: `{h}` is not a header name"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            AllowHeaders::list(values)
        };
        let exposed = EXPOSED.iter().map(|h| HeaderName::from_static(h));
        Ok(CorsLayer::new()
            .allow_origin(origins)
            .allow_methods(methods)
            .allow_headers(headers)
            .allow_credentials(credentials)
            .expose_headers(ExposeHeaders::list(exposed)))
    }
}

/// Parses a list flag as vLLM takes it (a JSON list, `["https://a.example"]`) or as a
/// comma-separated list.
///
/// # Errors
///
/// A message for JSON that is not a list of strings.
pub fn parse_list(text: &str) -> Result<Vec<String>, String> {
    let text = text.trim();
    if text.starts_with('[') {
        return serde_json::from_str::<Vec<String>>(text)
            .map_err(|e| format!("`{text}` is not a JSON list of strings: {e}"));
    }
    Ok(text
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_as_json_or_commas() {
        assert_eq!(
            parse_list(r#"["https://a.example", "http://b:3000"]"#).expect("json"),
            vec!["https://a.example", "http://b:3000"]
        );
        assert_eq!(
            parse_list("GET, POST").expect("commas"),
            vec!["GET", "POST"]
        );
        assert!(parse_list("[1]").is_err());
    }

    #[test]
    fn layers_build_for_credentials_with_wildcards() {
        let config = CorsConfig {
            allow_credentials: true,
            ..CorsConfig::default()
        };
        // tower-http panics when a wildcard meets credentials (as the layer is applied);
        // the request's values are echoed instead.
        let layer = config.layer().expect("layer");
        let _app: axum::Router = axum::Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .layer(layer);
        let bad = CorsConfig {
            allowed_origins: vec!["https://ok.example".into(), "bad\norigin".into()],
            ..CorsConfig::default()
        };
        assert!(bad
            .layer()
            .expect_err("bad origin")
            .contains("--allowed-origins"));
    }
}
