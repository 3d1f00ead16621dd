//! The hub's HTTP API, as the public hub and its mirrors serve it:
//!
//! - `GET {endpoint}/api/models/{repo}/revision/{rev}`: the commit a revision names
//!   (`sha`) and the files (`siblings`);
//! - `GET {endpoint}/api/models/{repo}/tree/{commit}?recursive=true`: every file with its
//!   size, git blob id (`oid`) and, for LFS files, `lfs.oid` (the sha256) and `lfs.size`;
//!   paginated with `Link: <url>; rel="next"`;
//! - `GET|HEAD {endpoint}/{repo}/resolve/{commit}/{path}`: the file; LFS files redirect to a
//!   CDN, and the hub's answer carries `X-Repo-Commit`, `X-Linked-Etag` (or `ETag`) and
//!   `X-Linked-Size`. Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`,
//!   `EntryNotFound`, `GatedRepo`) and `X-Error-Message`.
//!
//! Redirects are followed by hand so that the token is only sent to the hub's own origin,
//! never to a CDN, as `huggingface_hub` does.

use std::time::Duration;

use reqwest::header::{HeaderMap, AUTHORIZATION, LINK, LOCATION, RANGE, RETRY_AFTER};
use reqwest::{Method, Response, StatusCode, Url};
use serde::Deserialize;

use crate::hash::is_hex;
use crate::listing::{tree_file, TreeEntry};
pub use crate::listing::{LfsInfo, RepoFile};
use crate::repo::{quote, RepoId};
use crate::HubError;

/// Most bytes an API answer (one page of a listing) may have.
const MAX_JSON_BYTES: usize = 64 << 20;
/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 10;
/// Most pages of a tree listing (1000 files each on the public hub).
const MAX_PAGES: usize = 10_000;

/// How often and how patiently transient failures (connection errors, timeouts, cut
/// transfers, 408/429/5xx) are retried.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Tries per request or file in a row without progress (a transfer that moved bytes
    /// starts counting again).
    pub attempts: u32,
    /// The first wait; it doubles each time.
    pub first_delay: Duration,
    /// The longest wait (a `Retry-After` is also capped here).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 6,
            first_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The wait before try `attempt + 1` (`attempt` counts from 1).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self
            .first_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
        retry_after.unwrap_or(exp).min(self.max_delay)
    }
}

/// A failed try: the error, and whether trying again may help.
#[derive(Debug)]
pub(crate) struct Failure {
    pub error: HubError,
    pub transient: bool,
    pub retry_after: Option<Duration>,
}

impl Failure {
    pub fn fatal(error: HubError) -> Self {
        Self {
            error,
            transient: false,
            retry_after: None,
        }
    }

    pub fn transient(error: HubError) -> Self {
        Self {
            error,
            transient: true,
            retry_after: None,
        }
    }
}

impl From<HubError> for Failure {
    fn from(error: HubError) -> Self {
        Failure::fatal(error)
    }
}

/// What a request is about, for its error messages.
#[derive(Clone, Copy)]
pub(crate) struct Subject<'a> {
    pub repo: &'a RepoId,
    pub revision: &'a str,
    pub file: Option<&'a str>,
}

/// The hub's metadata headers gathered along a chain of redirects.
#[derive(Clone, Debug, Default)]
pub(crate) struct HubHeaders {
    pub commit: Option<String>,
    pub etag: Option<String>,
    pub size: Option<u64>,
}

impl HubHeaders {
    fn absorb(&mut self, headers: &HeaderMap, redirected: bool) {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        if self.commit.is_none() {
            self.commit = text("x-repo-commit").map(str::to_string);
        }
        if self.etag.is_none() {
            self.etag = text("x-linked-etag")
                .or_else(|| text("etag"))
                .map(normalize_etag);
        }
        if self.size.is_none() {
            self.size = text("x-linked-size")
                .or(if redirected {
                    None
                } else {
                    text("content-length")
                })
                .and_then(|s| s.trim().parse().ok());
        }
    }
}

/// `W/"abc"` and `"abc"` → `abc`, as `huggingface_hub` names blobs.
pub fn normalize_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// A client of one hub endpoint.
#[derive(Clone)]
pub struct HubClient {
    http: reqwest::Client,
    endpoint: String,
    token: Option<String>,
    pub(crate) retry: RetryPolicy,
    /// A transfer that receives nothing for this long is cut and resumed.
    pub(crate) idle_timeout: Duration,
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
}

impl HubClient {
    /// A client of `endpoint` (e.g. `https://huggingface.co`, or a mirror's `HF_ENDPOINT`),
    /// sending `token` as `Authorization: Bearer` to that origin only.
    pub fn new(endpoint: &str, token: Option<String>) -> Result<Self, HubError> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        let url = Url::parse(&endpoint).map_err(|e| HubError::BadResponse {
            url: endpoint.clone(),
            what: format!("HF_ENDPOINT is not a URL: {e}"),
        })?;
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(20))
            .user_agent(concat!("kimi-infer/", env!("CARGO_PKG_VERSION")));
        // A mirror on this machine is never reached through an HTTP(S)_PROXY.
        if matches!(url.host_str(), Some("localhost" | "127.0.0.1" | "[::1]")) {
            builder = builder.no_proxy();
        }
        let http = builder.build().map_err(|e| HubError::Transport {
            url: endpoint.clone(),
            what: format!("cannot build the HTTP client: {e}"),
        })?;
        Ok(Self {
            http,
            endpoint,
            token,
            retry: RetryPolicy::default(),
            idle_timeout: Duration::from_secs(60),
        })
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long a transfer may receive nothing before it is cut and resumed.
    pub fn with_idle_timeout(mut self, idle: Duration) -> Self {
        self.idle_timeout = idle;
        self
    }

    /// The endpoint, without a trailing `/`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether a token is sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The commit `revision` names, and the files the hub lists for it.
    pub(crate) async fn revision(
        &self,
        repo: &RepoId,
        revision: &str,
    ) -> Result<(String, Vec<String>), HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.endpoint,
            repo,
            quote(revision, "")
        );
        let subject = Subject {
            repo,
            revision,
            file: None,
        };
        let info: RevisionInfo = self
            .retrying(async || self.get_json(&url, subject).await)
            .await?;
        let sha = info.sha.ok_or_else(|| HubError::BadResponse {
            url: url.clone(),
            what: "no `sha` (the commit) in the revision's info".into(),
        })?;
        if !crate::repo::is_commit_hash(&sha) {
            return Err(HubError::BadResponse {
                url,
                what: format!("`sha` is `{sha}`, not a 40-hex commit"),
            });
        }
        Ok((
            sha,
            info.siblings.into_iter().map(|s| s.rfilename).collect(),
        ))
    }

    /// Every file of `repo` at `commit`, with sizes and checksums: the tree listing, or, from
    /// a mirror that has none, a `HEAD` of each of `siblings`.
    pub(crate) async fn list_files(
        &self,
        repo: &RepoId,
        commit: &str,
        siblings: &[String],
    ) -> Result<Vec<RepoFile>, HubError> {
        let subject = Subject {
            repo,
            revision: commit,
            file: None,
        };
        let mut url = format!(
            "{}/api/models/{}/tree/{}?recursive=true",
            self.endpoint,
            repo,
            quote(commit, "")
        );
        let mut files = Vec::new();
        for _ in 0..MAX_PAGES {
            let page = self
                .retrying(async || self.get_json_page::<Vec<TreeEntry>>(&url, subject).await)
                .await;
            let (entries, next) = match page {
                Ok(page) => page,
                // A mirror without the tree API: fall back to one HEAD per listed file.
                Err(HubError::Status { status: 404, .. } | HubError::RepoNotFound { .. })
                    if files.is_empty() =>
                {
                    tracing::info!(%repo, "the endpoint has no tree listing; asking for each file");
                    return self.head_files(repo, commit, siblings).await;
                }
                Err(e) => return Err(e),
            };
            for entry in entries {
                if let Some(file) = tree_file(entry, &url)? {
                    files.push(file);
                }
            }
            match next {
                Some(next) => url = next,
                None => return Ok(files),
            }
        }
        Err(HubError::BadResponse {
            url,
            what: format!("the tree listing has more than {MAX_PAGES} pages"),
        })
    }

    async fn head_files(
        &self,
        repo: &RepoId,
        commit: &str,
        siblings: &[String],
    ) -> Result<Vec<RepoFile>, HubError> {
        let mut files = Vec::with_capacity(siblings.len());
        for path in siblings {
            let subject = Subject {
                repo,
                revision: commit,
                file: Some(path),
            };
            let url = self.resolve_url(repo, commit, path);
            let headers = self
                .retrying(async || {
                    let (response, headers) = self.follow(Method::HEAD, &url, None, false).await?;
                    if !(response.status().is_success() || response.status().is_redirection()) {
                        return Err(self.status_failure(&url, response, subject).await);
                    }
                    Ok(headers)
                })
                .await?;
            let bad = |what: &str| HubError::BadResponse {
                url: url.clone(),
                what: what.to_string(),
            };
            let etag = headers.etag.ok_or_else(|| bad("no ETag for the file"))?;
            if !crate::listing::is_safe_etag(&etag) {
                return Err(bad(&format!("ETag `{etag}` cannot name a file")));
            }
            let size = headers.size.ok_or_else(|| bad("no size for the file"))?;
            let lfs = is_hex(&etag, 64).then(|| LfsInfo {
                sha256: etag.clone(),
                size,
            });
            files.push(RepoFile {
                path: path.clone(),
                size,
                blob_id: etag,
                lfs,
                xet_hash: None,
            });
        }
        Ok(files)
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{path}`.
    pub(crate) fn resolve_url(&self, repo: &RepoId, revision: &str, path: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            repo,
            quote(revision, ""),
            quote(path, "/")
        )
    }

    /// Opens a file for reading from byte `offset`, following the hub's redirect to its CDN.
    /// The caller reads the status: 200 (whole file), 206 (from `offset`) or 416.
    pub(crate) async fn open_file(
        &self,
        url: &str,
        offset: u64,
        subject: Subject<'_>,
    ) -> Result<(Response, HubHeaders), Failure> {
        let range = (offset > 0).then_some(offset);
        let (response, headers) = self.follow(Method::GET, url, range, true).await?;
        let status = response.status();
        if status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE {
            Ok((response, headers))
        } else {
            Err(self.status_failure(url, response, subject).await)
        }
    }

    /// Sends `method url`, following redirects by hand: the token goes only to the
    /// endpoint's origin; `follow_off_origin` false stops at a redirect that leaves it (its
    /// headers then describe the file, as the hub sends them).
    async fn follow(
        &self,
        method: Method,
        url: &str,
        range_from: Option<u64>,
        follow_off_origin: bool,
    ) -> Result<(Response, HubHeaders), Failure> {
        let endpoint_origin = Url::parse(&self.endpoint).ok().map(|u| u.origin());
        let mut current = Url::parse(url).map_err(|e| {
            Failure::fatal(HubError::BadResponse {
                url: url.to_string(),
                what: format!("not a URL: {e}"),
            })
        })?;
        let mut headers = HubHeaders::default();
        for _ in 0..=MAX_REDIRECTS {
            let mut request = self
                .http
                .request(method.clone(), current.clone())
                .header("accept-encoding", "identity");
            if let Some(offset) = range_from {
                request = request.header(RANGE, format!("bytes={offset}-"));
            }
            if let Some(token) = &self.token {
                if Some(current.origin()) == endpoint_origin {
                    request = request.header(AUTHORIZATION, format!("Bearer {token}"));
                }
            }
            let response = request
                .send()
                .await
                .map_err(|e| transport_failure(current.as_str(), e))?;
            let redirected = response.status().is_redirection();
            headers.absorb(response.headers(), redirected);
            if !redirected {
                return Ok((response, headers));
            }
            let Some(location) = response
                .headers()
                .get(LOCATION)
                .and_then(|l| l.to_str().ok())
            else {
                return Ok((response, headers));
            };
            let next = current.join(location).map_err(|e| {
                Failure::fatal(HubError::BadResponse {
                    url: current.to_string(),
                    what: format!("bad redirect `{location}`: {e}"),
                })
            })?;
            if !follow_off_origin && next.origin() != current.origin() {
                return Ok((response, headers));
            }
            current = next;
        }
        Err(Failure::fatal(HubError::BadResponse {
            url: url.to_string(),
            what: format!("more than {MAX_REDIRECTS} redirects"),
        }))
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        subject: Subject<'_>,
    ) -> Result<T, Failure> {
        Ok(self.get_json_page(url, subject).await?.0)
    }

    /// A JSON answer and the `Link: <...>; rel="next"` page after it.
    async fn get_json_page<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        subject: Subject<'_>,
    ) -> Result<(T, Option<String>), Failure> {
        let (response, _) = self.follow(Method::GET, url, None, true).await?;
        if !response.status().is_success() {
            return Err(self.status_failure(url, response, subject).await);
        }
        let next = response
            .headers()
            .get(LINK)
            .and_then(|l| l.to_str().ok())
            .and_then(next_link);
        let body = read_capped(response, url).await?;
        let value = serde_json::from_slice(&body).map_err(|e| {
            Failure::fatal(HubError::BadResponse {
                url: url.to_string(),
                what: format!("not the hub's JSON: {e}"),
            })
        })?;
        Ok((value, next))
    }

    /// Turns an error status into a failure that names the repository, revision and file.
    pub(crate) async fn status_failure(
        &self,
        url: &str,
        response: Response,
        subject: Subject<'_>,
    ) -> Failure {
        let status = response.status();
        let headers = response.headers().clone();
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let code = text("x-error-code").unwrap_or("").to_string();
        let message = text("x-error-message").map(str::to_string);
        let retry_after = text(RETRY_AFTER.as_str())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let repo = subject.repo.to_string();
        let file_part = subject
            .file
            .map(|f| format!(" for `{f}`"))
            .unwrap_or_default();
        let error = match (status.as_u16(), code.as_str()) {
            (_, "RepoNotFound") | (404, "") if subject.file.is_none() || code == "RepoNotFound" => {
                HubError::RepoNotFound {
                    repo,
                    endpoint: self.endpoint.clone(),
                    hint: if self.token.is_some() {
                        " (or it is private and the token's account cannot read it)"
                    } else {
                        " (or it is private or gated: set HF_TOKEN to a token that can read it)"
                    },
                }
            }
            (_, "RevisionNotFound") => HubError::RevisionNotFound {
                repo,
                revision: subject.revision.to_string(),
            },
            (_, "EntryNotFound") | (404, _) => HubError::EntryNotFound {
                repo,
                revision: subject.revision.to_string(),
                file: subject.file.unwrap_or("?").to_string(),
            },
            (401 | 403, _) | (_, "GatedRepo") => {
                let gated = code == "GatedRepo";
                let why = match (gated, self.token.is_some()) {
                    (true, false) => {
                        "the repository is gated and no token was sent: accept its \
                                      terms on its page on the hub, then set HF_TOKEN (or run \
                                      `hf auth login`)"
                    }
                    (true, true) => {
                        "the repository is gated and the token's account has not been \
                                     granted access (accept its terms on its page on the hub), \
                                     or the token lacks read permission"
                    }
                    (false, false) => "no token was sent: set HF_TOKEN to a token that can read it",
                    (false, true) => "the token was refused or cannot read this repository",
                };
                let reason = match message {
                    Some(m) => format!("{why} (the hub says: {m})"),
                    None => why.to_string(),
                };
                HubError::AccessDenied {
                    repo,
                    status: status.as_u16(),
                    file_part,
                    reason,
                }
            }
            _ => HubError::Status {
                url: url.to_string(),
                status: status.as_u16(),
                message: message.map(|m| format!(": {m}")).unwrap_or_default(),
            },
        };
        let transient = matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504);
        Failure {
            error,
            transient,
            retry_after,
        }
    }

    /// Runs `attempt` until it succeeds, fails for good, or the policy's tries run out.
    pub(crate) async fn retrying<T>(
        &self,
        mut attempt: impl AsyncFnMut() -> Result<T, Failure>,
    ) -> Result<T, HubError> {
        let mut tries = 0;
        loop {
            tries += 1;
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(f) if f.transient && tries < self.retry.attempts => {
                    let delay = self.retry.delay(tries, f.retry_after);
                    tracing::warn!(error = %f.error, "retrying in {delay:?} (try {tries} of {})", self.retry.attempts);
                    tokio::time::sleep(delay).await;
                }
                Err(f) => return Err(f.error),
            }
        }
    }
}

/// The `rel="next"` target of a `Link` header.
fn next_link(link: &str) -> Option<String> {
    link.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        let is_next = params
            .split(';')
            .any(|p| matches!(p.trim(), "rel=\"next\"" | "rel=next"));
        is_next.then(|| {
            target
                .trim()
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_string()
        })
    })
}

/// A transport error as a failure: connection errors and timeouts are worth a retry.
pub(crate) fn transport_failure(url: &str, e: reqwest::Error) -> Failure {
    let transient =
        e.is_connect() || e.is_timeout() || e.is_request() || e.is_body() || e.is_decode();
    let mut what = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !what.contains(&text) {
            what.push_str(": ");
            what.push_str(&text);
        }
        source = s.source();
    }
    Failure {
        error: HubError::Transport {
            url: url.to_string(),
            what,
        },
        transient,
        retry_after: None,
    }
}

/// Reads a (JSON) body of at most [`MAX_JSON_BYTES`].
async fn read_capped(mut response: Response, url: &str) -> Result<Vec<u8>, Failure> {
    let too_big = || {
        Failure::fatal(HubError::BadResponse {
            url: url.to_string(),
            what: format!("the answer is larger than {MAX_JSON_BYTES} bytes"),
        })
    };
    if response
        .content_length()
        .is_some_and(|n| n > MAX_JSON_BYTES as u64)
    {
        return Err(too_big());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| transport_failure(url, e))?
    {
        if body.len() + chunk.len() > MAX_JSON_BYTES {
            return Err(too_big());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_headers_and_etags() {
        assert_eq!(
            next_link(r#"<https://h/api/models/a/b/tree/main?cursor=xyz>; rel="next""#).as_deref(),
            Some("https://h/api/models/a/b/tree/main?cursor=xyz")
        );
        assert_eq!(next_link(r#"<https://h/x>; rel="prev""#), None);
        assert_eq!(normalize_etag(r#"W/"abc""#), "abc");
        assert_eq!(normalize_etag(r#""abc""#), "abc");
    }

    #[test]
    fn retry_delays_double_and_are_capped() {
        let p = RetryPolicy {
            attempts: 5,
            first_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
        };
        assert_eq!(p.delay(1, None), Duration::from_millis(100));
        assert_eq!(p.delay(3, None), Duration::from_millis(400));
        assert_eq!(p.delay(9, None), Duration::from_secs(1));
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }
}
