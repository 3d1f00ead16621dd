//! [`LocalHub`]: a local HTTP server speaking the hub's API (feature `testing`), for tests
//! of this crate, of the CLI, and of `huggingface_hub` against our cache.
//!
//! It serves repositories from memory as the public hub does: the revision info
//! (`/api/models/{repo}/revision/{rev}`), the recursive tree listing with LFS metadata,
//! paginated with `Link` headers, and `/{repo}/resolve/{rev}/{path}`: regular files directly
//! (`ETag` = git blob sha1), LFS files by a 302 to a second server on another port, the
//! "CDN" (`X-Linked-Etag` = sha256, `X-Linked-Size`), both honouring `Range`. Errors carry
//! the hub's `X-Error-Code`s; gated repositories want a bearer token. [`Faults`] make the
//! next transfers cut, stall, crawl, corrupt bytes, ignore `Range` or answer 503; every
//! request is logged with its `Range` and `Authorization` headers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Deserialize;

use crate::hash::{git_sha1_hex, sha256_hex};

/// A file of a hosted repository.
#[derive(Clone, Debug)]
pub struct HostedFile {
    pub path: String,
    pub bytes: Arc<Vec<u8>>,
    /// Stored in LFS: listed with `lfs.oid`, served from the CDN.
    pub lfs: bool,
}

/// A repository the local hub serves, at one commit on branch `main`.
#[derive(Clone, Debug)]
pub struct HostedRepo {
    pub id: String,
    pub files: Vec<HostedFile>,
    /// A gated repository: files are served only with `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

impl HostedRepo {
    pub fn new(id: &str) -> Self {
        Self {
            id: id.to_string(),
            files: Vec::new(),
            token: None,
        }
    }

    /// Adds a regular (git) file.
    pub fn file(mut self, path: &str, bytes: impl Into<Vec<u8>>) -> Self {
        self.files.push(HostedFile {
            path: path.into(),
            bytes: Arc::new(bytes.into()),
            lfs: false,
        });
        self
    }

    /// Adds a file stored in LFS.
    pub fn lfs_file(mut self, path: &str, bytes: impl Into<Vec<u8>>) -> Self {
        self.files.push(HostedFile {
            path: path.into(),
            bytes: Arc::new(bytes.into()),
            lfs: true,
        });
        self
    }

    /// Makes the repository gated behind `token`.
    pub fn gated(mut self, token: &str) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The commit: a hash of the files' ids, so that other contents give another commit.
    pub fn commit(&self) -> String {
        let ids: String = self
            .files
            .iter()
            .map(|f| format!("{}:{}\n", f.path, git_sha1_hex(&f.bytes)))
            .collect();
        git_sha1_hex(ids.as_bytes())
    }
}

/// The git-lfs pointer file that stands in the repository for an LFS object.
fn lfs_pointer(bytes: &[u8]) -> String {
    format!(
        "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {}\n",
        sha256_hex(bytes),
        bytes.len()
    )
}

/// What goes wrong with the next transfers (file bodies, from the hub or the CDN).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Only bodies of this file (`None`: every file).
    pub only: Option<String>,
    /// The next `cuts` bodies break off (connection reset) after this many bytes.
    pub cut_after: Option<u64>,
    pub cuts: usize,
    /// The next `stalls` bodies send this many bytes, then nothing for `stall_for`.
    pub stall_after: Option<u64>,
    pub stall_for: Duration,
    pub stalls: usize,
    /// Every body sends 16 KiB per this much time.
    pub chunk_delay: Option<Duration>,
    /// The next `corruptions` bodies that cover the file's middle byte flip it.
    pub corruptions: usize,
    /// Answer `Range` requests with the whole file (200).
    pub ignore_range: bool,
    /// The next `unavailable` file requests answer 503 with `Retry-After: 0`.
    pub unavailable: usize,
    /// The tree API answers 404 (a mirror without it).
    pub no_tree_api: bool,
    /// Entries per tree page (default 1000, as the hub).
    pub page_size: Option<usize>,
    /// The tree lists every LFS file with this size (a repository larger than the disk).
    pub listed_size: Option<u64>,
}

/// One request the servers saw.
#[derive(Clone, Debug)]
pub struct Logged {
    /// `hub` or `cdn`.
    pub server: &'static str,
    pub method: String,
    /// Path and query.
    pub uri: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

struct Shared {
    repos: Vec<HostedRepo>,
    endpoint: String,
    cdn: String,
    faults: Mutex<Faults>,
    log: Mutex<Vec<Logged>>,
    /// File bodies being sent now, and the most at once.
    bodies: AtomicUsize,
    most_bodies: AtomicUsize,
}

/// Counts a body in flight until it is dropped (sent, cut or abandoned).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(s: &Arc<Shared>) -> Self {
        let now = s.bodies.fetch_add(1, Ordering::SeqCst) + 1;
        s.most_bodies.fetch_max(now, Ordering::SeqCst);
        Self(s.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.bodies.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The running servers; stopped when dropped.
pub struct LocalHub {
    /// `http://127.0.0.1:PORT`: what `HF_ENDPOINT` is set to.
    pub endpoint: String,
    /// The CDN's origin.
    pub cdn: String,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LocalHub {
    /// Starts the hub and its CDN on free loopback ports, on a thread of their own.
    pub fn start(repos: Vec<HostedRepo>) -> Self {
        let hub = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the hub");
        let cdn = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the CDN");
        for l in [&hub, &cdn] {
            l.set_nonblocking(true).expect("nonblocking listener");
        }
        let addr = |l: &std::net::TcpListener| -> SocketAddr { l.local_addr().expect("address") };
        let shared = Arc::new(Shared {
            repos,
            endpoint: format!("http://{}", addr(&hub)),
            cdn: format!("http://{}", addr(&cdn)),
            faults: Mutex::new(Faults::default()),
            log: Mutex::new(Vec::new()),
            bodies: AtomicUsize::new(0),
            most_bodies: AtomicUsize::new(0),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let hub = tokio::net::TcpListener::from_std(hub).expect("hub listener");
                let cdn = tokio::net::TcpListener::from_std(cdn).expect("cdn listener");
                let hub_app = Router::new()
                    .route(
                        "/api/models/{org}/{name}/revision/{*rev}",
                        get(revision_info),
                    )
                    .route("/api/models/{org}/{name}/tree/{*rev}", get(tree))
                    .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
                    .with_state(state.clone());
                let cdn_app = Router::new()
                    .route("/lfs/{sha}", get(cdn_object))
                    .with_state(state);
                tokio::select! {
                    _ = axum::serve(hub, hub_app) => {}
                    _ = axum::serve(cdn, cdn_app) => {}
                    _ = stopped => {}
                }
            });
            rt.shutdown_timeout(Duration::from_millis(100));
        });
        Self {
            endpoint: shared.endpoint.clone(),
            cdn: shared.cdn.clone(),
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Replaces the faults of the next transfers.
    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.shared.faults) = faults;
    }

    /// Every request so far.
    pub fn log(&self) -> Vec<Logged> {
        lock(&self.shared.log).clone()
    }

    /// Forgets the requests so far (and the most bodies sent at once).
    pub fn clear_log(&self) {
        lock(&self.shared.log).clear();
        self.shared.most_bodies.store(0, Ordering::SeqCst);
    }

    /// The most file bodies that were being sent at the same time.
    pub fn most_concurrent_transfers(&self) -> usize {
        self.shared.most_bodies.load(Ordering::SeqCst)
    }
}

impl Drop for LocalHub {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn record(s: &Shared, server: &'static str, method: &Method, uri: &Uri, headers: &HeaderMap) {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    lock(&s.log).push(Logged {
        server,
        method: method.to_string(),
        uri: uri.to_string(),
        range: text("range"),
        authorization: text("authorization"),
    });
}

fn error(status: StatusCode, code: &str, message: &str, commit: Option<&str>) -> Response {
    let mut r = (status, message.to_string()).into_response();
    let h = r.headers_mut();
    h.insert("x-error-code", HeaderValue::from_str(code).expect("header"));
    h.insert(
        "x-error-message",
        HeaderValue::from_str(message).expect("header"),
    );
    if let Some(c) = commit {
        h.insert("x-repo-commit", HeaderValue::from_str(c).expect("header"));
    }
    r
}

/// The repository and the commit `rev` names, or the hub's 404.
fn find<'a>(
    s: &'a Shared,
    org: &str,
    name: &str,
    rev: &str,
) -> Result<(&'a HostedRepo, String), Box<Response>> {
    let id = format!("{org}/{name}");
    let Some(repo) = s.repos.iter().find(|r| r.id == id) else {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "RepoNotFound",
            "Repository not found",
            None,
        )));
    };
    let commit = repo.commit();
    if rev == "main" || rev == commit {
        Ok((repo, commit))
    } else {
        Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "RevisionNotFound",
            &format!("Invalid rev id: {rev}"),
            None,
        )))
    }
}

async fn revision_info(
    State(s): State<Arc<Shared>>,
    Path((org, name, rev)): Path<(String, String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&s, "hub", &method, &uri, &headers);
    let (repo, commit) = match find(&s, &org, &name, &rev) {
        Ok(found) => found,
        Err(r) => return *r,
    };
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|f| serde_json::json!({ "rfilename": f.path }))
        .collect();
    axum::Json(serde_json::json!({
        "_id": format!("{:0>24}", &commit[..24]),
        "id": repo.id,
        "modelId": repo.id,
        "sha": commit,
        "private": false,
        "disabled": false,
        "gated": if repo.token.is_some() { serde_json::json!("manual") } else { serde_json::json!(false) },
        "tags": [],
        "lastModified": "2026-01-01T00:00:00.000Z",
        "createdAt": "2026-01-01T00:00:00.000Z",
        "siblings": siblings,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct TreeQuery {
    #[serde(default)]
    cursor: Option<usize>,
    #[serde(default)]
    recursive: Option<String>,
}

async fn tree(
    State(s): State<Arc<Shared>>,
    Path((org, name, rev)): Path<(String, String, String)>,
    Query(q): Query<TreeQuery>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&s, "hub", &method, &uri, &headers);
    let faults = lock(&s.faults).clone();
    if faults.no_tree_api {
        return (StatusCode::NOT_FOUND, "Not Found").into_response();
    }
    let (repo, _) = match find(&s, &org, &name, &rev) {
        Ok(found) => found,
        Err(r) => return *r,
    };
    let recursive = q
        .recursive
        .as_deref()
        .is_some_and(|r| r.eq_ignore_ascii_case("true"));
    // Folders first, then files, as one flat listing.
    let mut entries = Vec::new();
    let mut folders: Vec<String> = Vec::new();
    for f in &repo.files {
        let mut prefix = String::new();
        for part in f
            .path
            .split('/')
            .collect::<Vec<_>>()
            .iter()
            .rev()
            .skip(1)
            .rev()
        {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            if !folders.contains(&prefix) {
                folders.push(prefix.clone());
            }
        }
    }
    for folder in &folders {
        if recursive || !folder.contains('/') {
            entries.push(serde_json::json!({
                "type": "directory", "oid": git_sha1_hex(folder.as_bytes()), "size": 0, "path": folder
            }));
        }
    }
    for f in &repo.files {
        if !recursive && f.path.contains('/') {
            continue;
        }
        let entry = if f.lfs {
            let pointer = lfs_pointer(&f.bytes);
            let size = faults.listed_size.unwrap_or(f.bytes.len() as u64);
            serde_json::json!({
                "type": "file",
                "oid": git_sha1_hex(pointer.as_bytes()),
                "size": size,
                "path": f.path,
                "lfs": { "oid": sha256_hex(&f.bytes), "size": size, "pointerSize": pointer.len() },
            })
        } else {
            serde_json::json!({
                "type": "file", "oid": git_sha1_hex(&f.bytes), "size": f.bytes.len(), "path": f.path,
            })
        };
        entries.push(entry);
    }
    let page = faults.page_size.unwrap_or(1000).max(1);
    let start = q.cursor.unwrap_or(0).min(entries.len());
    let end = (start + page).min(entries.len());
    let mut r = axum::Json(entries[start..end].to_vec()).into_response();
    if end < entries.len() {
        let next = format!(
            "<{}/api/models/{org}/{name}/tree/{rev}?recursive={}&cursor={end}>; rel=\"next\"",
            s.endpoint, recursive
        );
        r.headers_mut()
            .insert("link", HeaderValue::from_str(&next).expect("header"));
    }
    r
}

async fn resolve(
    State(s): State<Arc<Shared>>,
    Path((org, name, rev, path)): Path<(String, String, String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&s, "hub", &method, &uri, &headers);
    let (repo, commit) = match find(&s, &org, &name, &rev) {
        Ok(found) => found,
        Err(r) => return *r,
    };
    if let Some(token) = &repo.token {
        let sent = headers.get("authorization").and_then(|v| v.to_str().ok());
        if sent != Some(&format!("Bearer {token}")) {
            return error(
                StatusCode::UNAUTHORIZED,
                "GatedRepo",
                &format!(
                    "Access to model {} is restricted. You must have access to it and be authenticated to access it. Please log in.",
                    repo.id
                ),
                None,
            );
        }
    }
    let Some(file) = repo.files.iter().find(|f| f.path == path) else {
        return error(
            StatusCode::NOT_FOUND,
            "EntryNotFound",
            "Entry not found",
            Some(&commit),
        );
    };
    if take_unavailable(&s, &file.path) {
        let mut r = (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response();
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("0"));
        return r;
    }
    if file.lfs {
        let sha = sha256_hex(&file.bytes);
        let pointer = lfs_pointer(&file.bytes);
        let mut r = StatusCode::FOUND.into_response();
        let h = r.headers_mut();
        let put = |h: &mut HeaderMap, k: &'static str, v: String| {
            h.insert(k, HeaderValue::from_str(&v).expect("header"));
        };
        put(
            h,
            "location",
            format!("{}/lfs/{sha}?X-Amz-Signature=local", s.cdn),
        );
        put(h, "x-repo-commit", commit);
        put(h, "x-linked-etag", format!("\"{sha}\""));
        put(h, "x-linked-size", file.bytes.len().to_string());
        put(
            h,
            "etag",
            format!("\"{}\"", git_sha1_hex(pointer.as_bytes())),
        );
        return r;
    }
    let mut r = body(&s, file, &method, &headers);
    let h = r.headers_mut();
    h.insert(
        "x-repo-commit",
        HeaderValue::from_str(&commit).expect("header"),
    );
    h.insert(
        "etag",
        HeaderValue::from_str(&format!("\"{}\"", git_sha1_hex(&file.bytes))).expect("header"),
    );
    r
}

async fn cdn_object(
    State(s): State<Arc<Shared>>,
    Path(sha): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&s, "cdn", &method, &uri, &headers);
    let file = s
        .repos
        .iter()
        .flat_map(|r| r.files.iter())
        .find(|f| f.lfs && sha256_hex(&f.bytes) == sha);
    match file {
        Some(file) => {
            let file = file.clone();
            let mut r = body(&s, &file, &method, &headers);
            r.headers_mut().insert(
                "etag",
                HeaderValue::from_str(&format!("\"{sha}\"")).expect("header"),
            );
            r
        }
        None => (StatusCode::NOT_FOUND, "NoSuchKey").into_response(),
    }
}

fn take_unavailable(s: &Shared, path: &str) -> bool {
    let mut f = lock(&s.faults);
    if f.unavailable > 0 && f.only.as_deref().is_none_or(|o| o == path) {
        f.unavailable -= 1;
        return true;
    }
    false
}

/// A file body: the `Range` asked for (or all), with the faults that apply.
fn body(s: &Arc<Shared>, file: &HostedFile, method: &Method, headers: &HeaderMap) -> Response {
    let total = file.bytes.len() as u64;
    let mut faults = lock(&s.faults);
    let applies = faults.only.as_deref().is_none_or(|o| o == file.path);
    let range = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(a, b)| {
            let start: u64 = a.parse().ok()?;
            let end: u64 = if b.is_empty() {
                total.saturating_sub(1)
            } else {
                b.parse().ok()?
            };
            Some((start, end.min(total.saturating_sub(1))))
        })
        .filter(|_| !(applies && faults.ignore_range));
    let (status, start, end) = match range {
        Some((start, _)) if start >= total => {
            let mut r = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            r.headers_mut().insert(
                "content-range",
                HeaderValue::from_str(&format!("bytes */{total}")).expect("header"),
            );
            return r;
        }
        Some((start, end)) => (StatusCode::PARTIAL_CONTENT, start, end + 1),
        None => (StatusCode::OK, 0, total),
    };
    let mut plan = BodyPlan {
        _in_flight: (method == Method::GET).then(|| InFlight::new(s)),
        bytes: file.bytes.clone(),
        pos: start,
        end,
        cut_at: None,
        stall_at: None,
        stall_for: faults.stall_for,
        chunk_delay: None,
        flip: None,
    };
    if applies && method == Method::GET {
        if faults.cuts > 0 {
            if let Some(n) = faults.cut_after {
                faults.cuts -= 1;
                plan.cut_at = Some(start + n);
            }
        }
        if faults.stalls > 0 {
            if let Some(n) = faults.stall_after {
                faults.stalls -= 1;
                plan.stall_at = Some(start + n);
            }
        }
        let middle = total / 2;
        if faults.corruptions > 0 && (start..end).contains(&middle) {
            faults.corruptions -= 1;
            plan.flip = Some(middle);
        }
        plan.chunk_delay = faults.chunk_delay;
    }
    drop(faults);
    let len = end - start;
    let stream = futures_util::stream::unfold(plan, |mut p| async move {
        if p.pos >= p.end {
            return None;
        }
        if p.stall_at.is_some_and(|at| p.pos >= at) {
            p.stall_at = None;
            tokio::time::sleep(p.stall_for).await;
        }
        if p.cut_at.is_some_and(|at| p.pos >= at) {
            // Let the server flush what it sent before the connection drops, as a real cut
            // loses only what was still in flight.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let cut = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut by the test");
            p.pos = p.end;
            return Some((Err(cut), p));
        }
        if let Some(d) = p.chunk_delay {
            tokio::time::sleep(d).await;
        }
        // Stop each chunk at the next fault boundary so that faults land on exact bytes.
        let mut stop = (p.pos + 16 * 1024).min(p.end);
        for at in [p.cut_at, p.stall_at].into_iter().flatten() {
            if at > p.pos {
                stop = stop.min(at);
            }
        }
        let mut chunk = p.bytes[p.pos as usize..stop as usize].to_vec();
        if let Some(at) = p.flip {
            if (p.pos..stop).contains(&at) {
                chunk[(at - p.pos) as usize] ^= 0x5a;
            }
        }
        p.pos = stop;
        Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), p))
    });
    let mut r = Response::new(Body::from_stream(stream));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert("accept-ranges", HeaderValue::from_static("bytes"));
    h.insert("content-length", HeaderValue::from(len));
    if status == StatusCode::PARTIAL_CONTENT {
        h.insert(
            "content-range",
            HeaderValue::from_str(&format!("bytes {start}-{}/{total}", end - 1)).expect("header"),
        );
    }
    r
}

struct BodyPlan {
    _in_flight: Option<InFlight>,
    bytes: Arc<Vec<u8>>,
    pos: u64,
    end: u64,
    cut_at: Option<u64>,
    stall_at: Option<u64>,
    stall_for: Duration,
    chunk_delay: Option<Duration>,
    flip: Option<u64>,
}
