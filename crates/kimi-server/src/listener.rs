//! The accept loop: HTTP/1.1 connections (plain or TLS) with a deadline for each request
//! head (which also closes idle keep-alive connections), a cap on open connections, and a
//! graceful shutdown with a deadline. `serve` and the gateway both run on it.
//!
//! ```text
//! accept ─► open < max_connections ─► [TLS handshake ≤ HANDSHAKE_TIMEOUT] ─► hyper HTTP/1.1
//!        │                             (head within keep_alive_timeout) ─► router
//!        └► at the cap ─► refusal task (≤ OVERFLOW_TASKS): GET /health → 200, else 503
//!                     └► none free, or TLS ─► 503 written at once (TLS: closed), closed
//! shutdown ─► stop accepting ─► connections finish their response and close
//!          └► shutdown_timeout passed ─► the rest are cut (their requests cancelled)
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tower_service::Service;

use crate::error::ServerError;

/// How long a TLS client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Open and refused connections, for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    /// HTTP connections being served now.
    pub open: AtomicUsize,
    /// Connections refused at the cap (`max_connections`).
    pub refused: AtomicU64,
}

/// How a listener serves its connections.
#[derive(Clone, Debug)]
pub struct ListenConfig {
    /// Most connections open at once; past it, connections get a 503 (a `/health` probe
    /// still gets its 200; over TLS they are closed).
    pub max_connections: usize,
    /// A connection must send a complete request head within this of opening or of its
    /// previous response. `None` waits forever.
    pub keep_alive_timeout: Option<Duration>,
    /// After the shutdown signal, how long open requests may run. `None` waits for them.
    pub shutdown_timeout: Option<Duration>,
    /// TLS (rustls), when set: every connection must complete a handshake first.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Connections past the cap that are read for a `/health` probe at the same time; more
/// get their 503 without being read.
const OVERFLOW_TASKS: usize = 64;
/// How long a connection past the cap has to send its request head.
const OVERFLOW_READ: Duration = Duration::from_secs(1);

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 163\r\n\r\n\
{\"error\":{\"message\":\"The server has too many open connections (--max-connections). \
Retry later.\",\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}";
const HEALTHY: &[u8] = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module docs).
///
/// # Errors
///
/// [`ServerError::Config`] for a zero `max_connections`.
pub async fn serve_app(
    listener: TcpListener,
    app: Router,
    config: ListenConfig,
    counters: Arc<ConnectionCounters>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    if config.max_connections == 0 {
        return Err(ServerError::Config(
            "max_connections must be at least 1".into(),
        ));
    }
    let open = Arc::new(Semaphore::new(config.max_connections));
    let overflow = Arc::new(Semaphore::new(OVERFLOW_TASKS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(config.keep_alive_timeout)
        .keep_alive(true);
    let tls = config.tls.clone().map(TlsAcceptor::from);
    let (closing_tx, closing) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        accept_failed(&e).await;
                        continue;
                    }
                };
                // Streams write one small SSE event per token: without TCP_NODELAY, Nagle's
                // algorithm holds each back until the client's delayed ACK (up to 40 ms).
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!("cannot set TCP_NODELAY: {e}");
                }
                match Arc::clone(&open).try_acquire_owned() {
                    Ok(permit) => {
                        let connection = Connection {
                            app: app.clone(),
                            http: http.clone(),
                            counters: Arc::clone(&counters),
                            closing: closing.clone(),
                            _permit: permit,
                        };
                        connections.spawn(connection.serve(tcp, peer, tls.clone()));
                    }
                    // A TLS client cannot read a plain-text 503: it is closed.
                    Err(_) if tls.is_some() => {
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        drop(tcp);
                    }
                    Err(_) => refuse(tcp, peer, &overflow, &counters),
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drain(connections, config.shutdown_timeout).await;
    Ok(())
}

/// Waits for the open connections to finish, cutting them at `deadline`.
async fn drain(mut connections: JoinSet<()>, deadline: Option<Duration>) {
    if !connections.is_empty() {
        tracing::info!(
            "shutting down: waiting for {} open connections{}",
            connections.len(),
            deadline.map_or(String::new(), |d| format!(
                " (at most {}s)",
                d.as_secs_f64()
            ))
        );
    }
    let all = async { while connections.join_next().await.is_some() {} };
    match deadline {
        None => all.await,
        Some(limit) => {
            if tokio::time::timeout(limit, all).await.is_err() {
                tracing::warn!(
                    "shutdown timeout ({}s) passed: closing {} connections with requests \
                     still running",
                    limit.as_secs_f64(),
                    connections.len()
                );
                connections.shutdown().await;
            }
        }
    }
}

/// A failed `accept`: the peer gave up (retry at once), or the process is out of file
/// descriptors or memory (wait a little so that the loop does not spin).
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted => {}
        _ => {
            tracing::error!("cannot accept a connection: {e}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One accepted connection under the cap.
struct Connection {
    app: Router,
    http: hyper::server::conn::http1::Builder,
    counters: Arc<ConnectionCounters>,
    closing: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
}

impl Connection {
    async fn serve(self, tcp: TcpStream, peer: SocketAddr, tls: Option<TlsAcceptor>) {
        let Some(tls) = tls else {
            return self.serve_io(tcp, peer).await;
        };
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
            Ok(Ok(stream)) => self.serve_io(stream, peer).await,
            // A scanner, a client that does not trust the certificate, a plain-HTTP request.
            Ok(Err(e)) => tracing::debug!("TLS handshake with {peer} failed: {e}"),
            Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
        }
    }

    async fn serve_io<S>(mut self, io: S, peer: SocketAddr)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let counters = Arc::clone(&self.counters);
        counters.open.fetch_add(1, Ordering::Relaxed);
        let app = self.app.clone();
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(ConnectInfo(peer));
            app.clone().call(request)
        });
        let mut conn = pin!(self.http.serve_connection(TokioIo::new(io), service));
        let result = tokio::select! {
            result = conn.as_mut() => result,
            () = closed(&mut self.closing) => {
                // Finish the response in progress, then close.
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            // Timeouts, resets and malformed requests: the client's doing, not ours.
            tracing::debug!("connection from {peer}: {e}");
        }
        counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Resolves once shutdown has begun (or the accept loop is gone).
async fn closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|closing| *closing).await;
}

/// Answers a connection past the cap: a `/health` probe gets 200 (while refusal tasks are
/// free), anything else a 503 with `Retry-After`.
fn refuse(
    tcp: TcpStream,
    peer: SocketAddr,
    overflow: &Arc<Semaphore>,
    counters: &ConnectionCounters,
) {
    let Ok(permit) = Arc::clone(overflow).try_acquire_owned() else {
        counters.refused.fetch_add(1, Ordering::Relaxed);
        let _ = tcp.try_write(BUSY);
        return;
    };
    let refused = probe_is_health(tcp, peer, permit);
    // Counted up front: the answer may well be a 503.
    counters.refused.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(refused);
}

async fn probe_is_health(mut tcp: TcpStream, peer: SocketAddr, _permit: OwnedSemaphorePermit) {
    let mut head = [0u8; 1024];
    let mut len = 0;
    let read = tokio::time::timeout(OVERFLOW_READ, async {
        while len < head.len() && !head[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            match tcp.read(&mut head[len..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => len += n,
            }
        }
    });
    let _ = read.await;
    let line = &head[..len];
    let health = line.starts_with(b"GET /health ") || line.starts_with(b"GET /health?");
    let answer = if health { HEALTHY } else { BUSY };
    let write = async {
        tcp.write_all(answer).await?;
        tcp.shutdown().await
    };
    if let Err(e) = tokio::time::timeout(OVERFLOW_READ, write).await {
        tracing::debug!("refusing {peer}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_is_a_complete_response() {
        let text = std::str::from_utf8(BUSY).expect("ASCII");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|n| n.parse().ok())
            .expect("content-length");
        assert_eq!(length, body.len());
        let json: serde_json::Value = serde_json::from_str(body).expect("JSON body");
        assert_eq!(json["error"]["code"], "too_many_connections");
    }
}
