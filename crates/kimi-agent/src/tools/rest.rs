//! REST tools: one HTTP request per call, arguments placed in the path, the query string,
//! headers or a JSON body; the response's status and (size-capped) body go to the model.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::Method;
use serde_json::{Map, Value};

use super::{scalar_text, seconds, ToolOutput};
use crate::config::{expand_env, RestToolConfig};
use crate::http::{body_text, describe_error, read_capped};

/// Which arguments go into the query string.
#[derive(Debug, Clone)]
pub enum QueryArgs {
    /// These, by name.
    Listed(Vec<String>),
    /// Every argument not placed elsewhere.
    Remaining,
}

/// What the request body is.
#[derive(Debug, Clone)]
pub enum BodyArgs {
    /// No body.
    None,
    /// A JSON object of every argument not placed elsewhere.
    Remaining,
    /// The value of this argument, as JSON.
    Field(String),
}

/// A configured REST tool.
#[derive(Debug)]
pub struct RestTool {
    client: reqwest::Client,
    method: Method,
    url: String,
    path_args: Vec<String>,
    query: QueryArgs,
    header_args: Vec<String>,
    body: BodyArgs,
    headers: HeaderMap,
    timeout: Duration,
    max_bytes: usize,
}

impl RestTool {
    /// From a `[[tool]] type = "rest"` table.
    ///
    /// # Errors
    ///
    /// A bad method, URL, header or limit.
    pub fn from_config(c: &RestToolConfig, client: reqwest::Client) -> Result<RestTool, String> {
        let method = parse_method(&c.method)?;
        let path_args = url_placeholders(&c.url)?;
        let takes_body = !matches!(method, Method::GET | Method::HEAD | Method::DELETE);
        let query = match &c.query {
            Some(names) => QueryArgs::Listed(names.clone()),
            None if takes_body => QueryArgs::Listed(Vec::new()),
            None => QueryArgs::Remaining,
        };
        let body = if takes_body {
            BodyArgs::Remaining
        } else {
            BodyArgs::None
        };
        RestTool::new(RestParts {
            client,
            method,
            url: c.url.clone(),
            path_args,
            query,
            header_args: Vec::new(),
            body,
            headers: headers(&c.headers)?,
            timeout: seconds(c.timeout_seconds, "timeout_seconds")?,
            max_bytes: c.max_response_bytes,
        })
    }

    /// From parts (the OpenAPI reader builds these).
    ///
    /// # Errors
    ///
    /// A URL that cannot be parsed once its placeholders are filled, or a zero size cap.
    pub fn new(p: RestParts) -> Result<RestTool, String> {
        let probe = fill_url(&p.url, &p.path_args, &Map::new(), true)?;
        reqwest::Url::parse(&probe).map_err(|e| format!("`{}` is not a URL: {e}", p.url))?;
        if p.max_bytes == 0 {
            return Err("max_response_bytes must be at least 1".into());
        }
        Ok(RestTool {
            client: p.client,
            method: p.method,
            url: p.url,
            path_args: p.path_args,
            query: p.query,
            header_args: p.header_args,
            body: p.body,
            headers: p.headers,
            timeout: p.timeout,
            max_bytes: p.max_bytes,
        })
    }

    /// Sends the request for `args`.
    pub async fn call(&self, args: &Map<String, Value>) -> ToolOutput {
        match self.request(args) {
            Ok(request) => self.send(request).await,
            Err(e) => ToolOutput::error(e),
        }
    }

    fn request(&self, args: &Map<String, Value>) -> Result<reqwest::RequestBuilder, String> {
        let url = fill_url(&self.url, &self.path_args, args, false)?;
        let mut url = reqwest::Url::parse(&url).map_err(|e| format!("bad URL `{url}`: {e}"))?;
        let placed = |name: &String| {
            self.path_args.contains(name)
                || self.header_args.contains(name)
                || matches!(&self.body, BodyArgs::Field(f) if f == name)
        };
        let query_names: Vec<&String> = match &self.query {
            QueryArgs::Listed(names) => names.iter().collect(),
            QueryArgs::Remaining => args.keys().filter(|k| !placed(k)).collect(),
        };
        {
            let mut pairs = url.query_pairs_mut();
            for name in &query_names {
                match args.get(*name) {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(items)) => {
                        for item in items {
                            pairs.append_pair(name, &query_text(item));
                        }
                    }
                    Some(value) => {
                        pairs.append_pair(name, &query_text(value));
                    }
                }
            }
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        let mut request = self
            .client
            .request(self.method.clone(), url)
            .headers(self.headers.clone())
            .timeout(self.timeout);
        for name in &self.header_args {
            if let Some(value) = args.get(name).and_then(scalar_text) {
                let value = HeaderValue::from_str(&value)
                    .map_err(|_| format!("the argument `{name}` is not a valid header value"))?;
                request = request.header(name.as_str(), value);
            }
        }
        let body = match &self.body {
            BodyArgs::None => None,
            BodyArgs::Field(name) => args.get(name).cloned(),
            BodyArgs::Remaining => {
                let rest: Map<String, Value> = args
                    .iter()
                    .filter(|(k, _)| !placed(k) && !query_names.contains(k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                Some(Value::Object(rest))
            }
        };
        if let Some(body) = body {
            request = request.json(&body);
        }
        Ok(request)
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> ToolOutput {
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                return ToolOutput::error(format!("the request failed: {}", describe_error(&e)))
            }
        };
        let status = response.status();
        let body = match read_capped(response, self.max_bytes).await {
            Ok(body) => body,
            Err(e) => {
                return ToolOutput::error(format!(
                    "HTTP {status}, then reading the body failed: {}",
                    describe_error(&e)
                ))
            }
        };
        let text = body_text(&body, self.max_bytes);
        if status.is_success() {
            ToolOutput::ok(text)
        } else {
            ToolOutput::error(format!("HTTP {status}: {text}"))
        }
    }
}

/// The fields of [`RestTool::new`].
#[derive(Debug)]
pub struct RestParts {
    /// Shared client.
    pub client: reqwest::Client,
    /// Method.
    pub method: Method,
    /// URL with `{name}` placeholders.
    pub url: String,
    /// Arguments in the URL.
    pub path_args: Vec<String>,
    /// Arguments in the query string.
    pub query: QueryArgs,
    /// Arguments sent as headers.
    pub header_args: Vec<String>,
    /// The body.
    pub body: BodyArgs,
    /// Fixed headers.
    pub headers: HeaderMap,
    /// Request timeout.
    pub timeout: Duration,
    /// Response size cap.
    pub max_bytes: usize,
}

pub(crate) fn parse_method(text: &str) -> Result<Method, String> {
    let upper = text.to_ascii_uppercase();
    match upper.as_str() {
        "GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "HEAD" => {
            Method::from_bytes(upper.as_bytes())
                .map_err(|_| format!("`{text}` is not an HTTP method"))
        }
        _ => Err(format!(
            "`{text}` is not a supported method (GET, POST, PUT, PATCH, DELETE, HEAD)"
        )),
    }
}

/// Fixed headers, `${NAME}` taken from the environment.
pub(crate) fn headers(
    table: &std::collections::BTreeMap<String, String>,
) -> Result<HeaderMap, String> {
    let mut map = HeaderMap::new();
    for (name, value) in table {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("`{name}` is not a valid header name"))?;
        let value = expand_env(value).map_err(|e| format!("header `{name}`: {e}"))?;
        let mut value = HeaderValue::from_str(&value)
            .map_err(|_| format!("header `{name}`: the value is not a valid header value"))?;
        // Kept out of debug output and logs.
        value.set_sensitive(true);
        map.insert(header, value);
    }
    Ok(map)
}

/// The `{name}` placeholders of a URL template.
pub(crate) fn url_placeholders(url: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let mut rest = url;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`{url}`: a `{{` without its `}}`"))?;
        let name = &after[..end];
        if name.is_empty() || name.contains('{') {
            return Err(format!("`{url}`: a malformed placeholder"));
        }
        names.push(name.to_string());
        rest = &after[end + 1..];
    }
    Ok(names)
}

/// The URL with each placeholder replaced by its percent-encoded argument (`probe`: by a
/// stand-in, to check the template).
fn fill_url(
    url: &str,
    names: &[String],
    args: &Map<String, Value>,
    probe: bool,
) -> Result<String, String> {
    let mut out = url.to_string();
    for name in names {
        let value = if probe {
            "x".to_string()
        } else {
            let value = args
                .get(name)
                .ok_or_else(|| format!("the argument `{name}` is required (it is in the URL)"))?;
            scalar_text(value)
                .ok_or_else(|| format!("the argument `{name}` must be a string or number"))?
        };
        out = out.replace(&format!("{{{name}}}"), &percent_encode(&value));
    }
    Ok(out)
}

/// RFC 3986 percent-encoding of everything but the unreserved characters, so that a value
/// stays one path segment (`../x` becomes `..%2Fx`).
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query_text(value: &Value) -> String {
    scalar_text(value).unwrap_or_else(|| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_values_stay_in_their_segment() {
        assert_eq!(percent_encode("../etc/passwd"), "..%2Fetc%2Fpasswd");
        assert_eq!(percent_encode("a b?c"), "a%20b%3Fc");
        assert_eq!(percent_encode("é"), "%C3%A9");
        assert_eq!(url_placeholders("http://h/{a}/x/{b}").unwrap(), ["a", "b"]);
        assert!(url_placeholders("http://h/{a").is_err());
    }

    #[test]
    fn methods_and_headers_are_checked() {
        assert!(parse_method("get").is_ok());
        assert!(parse_method("CONNECT").is_err());
        let mut t = std::collections::BTreeMap::new();
        t.insert("bad name".to_string(), "x".to_string());
        assert!(headers(&t).is_err());
    }
}
