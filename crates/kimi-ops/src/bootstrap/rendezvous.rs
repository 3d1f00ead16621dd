//! The rendezvous of rank processes: rank 0 listens on the master port, every other rank
//! connects and says who it is, rank 0 answers each with one payload (the NCCL unique id)
//! once all have come, and the connections stay open as the control links of the job
//! (barriers and small control messages; never tensors).
//!
//! ```text
//! rank r ──connect (retried until the deadline)──► rank 0 :MASTER_PORT
//!        ──Hello {magic, rank, world}────────────►   (all world-1 ranks, distinct, same world)
//!        ◄──Welcome {payload}────────────────────   (to each, once all have come)
//! ```
//!
//! Every wait has a deadline, and a peer that closes its end (a dead process) is named.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::BootstrapError;

/// First bytes of every hello: a rendezvous of kimi-infer, of this protocol version.
const MAGIC: &[u8; 8] = b"KIMI-RV1";
/// Frame kinds.
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const ARRIVE: u8 = 3;
const GO: u8 = 4;
/// A control message ([`Link::send`]).
pub const MESSAGE: u8 = 16;
/// Rank 0 ends the job normally (a link that closes without it means a dead process).
pub const BYE: u8 = 17;
/// Control frames carry ids, block tables and error text: far below this.
const MAX_FRAME: usize = 64 << 20;

type Result<T> = std::result::Result<T, BootstrapError>;

/// One end of the control connection between rank 0 and rank `peer`.
#[derive(Debug)]
pub struct Link {
    stream: TcpStream,
    /// The rank at the other end.
    peer: usize,
}

impl Link {
    /// The rank at the other end.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Sends one frame of `kind` (a control message: [`MESSAGE`]).
    pub fn send(&mut self, kind: u8, body: &[u8]) -> Result<()> {
        if body.len() > MAX_FRAME {
            return Err(BootstrapError::Protocol(format!(
                "a control frame of {} bytes to rank {} (control messages are small)",
                body.len(),
                self.peer
            )));
        }
        let mut frame = Vec::with_capacity(5 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.push(kind);
        frame.extend_from_slice(body);
        self.stream
            .write_all(&frame)
            .map_err(|e| self.lost(e, "sending"))
    }

    /// The next frame, waiting until `deadline` (`None`: as long as it takes, for a worker
    /// idle between steps); its kind and body.
    pub fn recv(&mut self, deadline: Option<Instant>, what: &str) -> Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        self.read_exact(&mut head, deadline, what)?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > MAX_FRAME {
            return Err(BootstrapError::Protocol(format!(
                "rank {} announced a control frame of {len} bytes while {what}",
                self.peer
            )));
        }
        let mut body = vec![0u8; len];
        self.read_exact(&mut body, deadline, what)?;
        Ok((head[4], body))
    }

    /// The next frame, which must be of `kind`.
    fn expect(&mut self, kind: u8, deadline: Instant, what: &str) -> Result<Vec<u8>> {
        let (k, body) = self.recv(Some(deadline), what)?;
        if k != kind {
            return Err(BootstrapError::Protocol(format!(
                "rank {} sent a frame of kind {k} while {what} (expected {kind})",
                self.peer
            )));
        }
        Ok(body)
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Option<Instant>, what: &str) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let wait = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(BootstrapError::Timeout(format!(
                            "rank {} sent nothing while {what}",
                            self.peer
                        )));
                    }
                    Some(left)
                }
                None => None,
            };
            self.stream
                .set_read_timeout(wait)
                .map_err(|e| self.lost(e, what))?;
            match self.stream.read(&mut buf[done..]) {
                Ok(0) => return Err(BootstrapError::PeerClosed(self.peer, what.to_string())),
                Ok(n) => done += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.lost(e, what)),
            }
        }
        Ok(())
    }

    fn lost(&self, e: std::io::Error, what: &str) -> BootstrapError {
        match e.kind() {
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
                BootstrapError::PeerClosed(self.peer, what.to_string())
            }
            _ => BootstrapError::Io(format!("rank {} while {what}: {e}", self.peer)),
        }
    }

    /// Whether the peer has closed its end, looking for up to `wait` without reading:
    /// `Some(true)` closed, `Some(false)` a frame is waiting, `None` nothing yet.
    pub fn peek_closed(&self, wait: Duration) -> Option<bool> {
        let _ = self
            .stream
            .set_read_timeout(Some(wait.max(Duration::from_millis(1))));
        let mut b = [0u8; 1];
        match self.stream.peek(&mut b) {
            Ok(0) => Some(true),
            Ok(_) => Some(false),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => None,
            Err(e) if e.kind() == ErrorKind::Interrupted => None,
            Err(_) => Some(true),
        }
    }

    /// Closes both directions (the peer's next read ends).
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Rank 0's side: a link to every other rank, `links[r - 1]` to rank `r`.
#[derive(Debug)]
pub struct Lead {
    links: Vec<Link>,
}

/// Listens on `port` (every interface) for the `world - 1` other ranks until `timeout`,
/// then hands each of them `payload`.
pub fn lead(port: u16, world: usize, payload: &[u8], timeout: Duration) -> Result<Lead> {
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| BootstrapError::Io(format!("rank 0 cannot listen on port {port}: {e}")))?;
    lead_on(listener, world, payload, timeout)
}

/// [`lead`] on a listener already bound (tests bind port 0).
pub fn lead_on(
    listener: TcpListener,
    world: usize,
    payload: &[u8],
    timeout: Duration,
) -> Result<Lead> {
    let deadline = Instant::now() + timeout;
    let io = |e: std::io::Error| BootstrapError::Io(format!("rank 0 accepting ranks: {e}"));
    listener.set_nonblocking(true).map_err(io)?;
    let mut links: Vec<Option<Link>> = (1..world).map(|_| None).collect();
    while links.iter().any(Option::is_none) {
        let (stream, from) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..world)
                        .filter(|r| links[r - 1].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(BootstrapError::Timeout(format!(
                        "rank(s) {} did not arrive at the rendezvous within {timeout:?}",
                        missing.join(", ")
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(io(e)),
        };
        stream.set_nonblocking(false).map_err(io)?;
        let _ = stream.set_nodelay(true);
        // Until its hello names it, the peer is "a connection from <addr>".
        let mut link = Link {
            stream,
            peer: usize::MAX,
        };
        let hello = link
            .expect(HELLO, deadline, &format!("greeting rank 0 (from {from})"))
            .map_err(|e| BootstrapError::Protocol(format!("a connection from {from}: {e}")))?;
        let (rank, their_world) = parse_hello(&hello).ok_or_else(|| {
            BootstrapError::Protocol(format!("a connection from {from} is not a kimi-infer rank"))
        })?;
        if their_world != world {
            return Err(BootstrapError::Protocol(format!(
                "rank {rank} (from {from}) was started for {their_world} ranks, rank 0 for {world}"
            )));
        }
        if rank == 0 || rank >= world {
            return Err(BootstrapError::Protocol(format!(
                "a rank {rank} (from {from}) in a group of {world}"
            )));
        }
        if links[rank - 1].is_some() {
            return Err(BootstrapError::Protocol(format!(
                "rank {rank} arrived twice (again from {from})"
            )));
        }
        link.peer = rank;
        links[rank - 1] = Some(link);
    }
    let mut links: Vec<Link> = links.into_iter().flatten().collect();
    for l in &mut links {
        l.send(WELCOME, payload)?;
    }
    Ok(Lead { links })
}

fn parse_hello(b: &[u8]) -> Option<(usize, usize)> {
    if b.len() != 16 || &b[..8] != MAGIC {
        return None;
    }
    let rank = u32::from_le_bytes(b[8..12].try_into().ok()?) as usize;
    let world = u32::from_le_bytes(b[12..16].try_into().ok()?) as usize;
    Some((rank, world))
}

/// Rank `rank`'s side: connects to rank 0 at `addr:port` (retrying until `timeout`), says
/// who it is and returns the link and rank 0's payload.
pub fn join(
    addr: &str,
    port: u16,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<(Link, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let target = format!("{addr}:{port}");
    let stream = loop {
        let tried = target
            .to_socket_addrs()
            .map_err(|e| {
                BootstrapError::Io(format!("rank {rank}: the master address {target}: {e}"))
            })
            .and_then(|mut addrs| {
                addrs.next().ok_or_else(|| {
                    BootstrapError::Io(format!("rank {rank}: {target} has no address"))
                })
            });
        let left = deadline.saturating_duration_since(Instant::now());
        let connected = match tried {
            Ok(sa) => TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(1))).ok(),
            // A name that does not resolve yet (a pod starting) is retried like a refusal.
            Err(_) => None,
        };
        if let Some(s) = connected {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(BootstrapError::Timeout(format!(
                "rank {rank}: rank 0 at {target} did not answer within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = stream.set_nodelay(true);
    let mut link = Link { stream, peer: 0 };
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world as u32).to_le_bytes());
    link.send(HELLO, &hello)?;
    let payload = link.expect(
        WELCOME,
        deadline,
        "waiting for the other ranks at the rendezvous",
    )?;
    Ok((link, payload))
}

impl Lead {
    /// The links, `[r - 1]` to rank `r`, for good (the job's control links).
    pub fn into_links(self) -> Vec<Link> {
        self.links
    }

    /// The links, `[r - 1]` to rank `r`.
    pub fn links(&mut self) -> &mut [Link] {
        &mut self.links
    }

    /// Waits until every rank has called [`Link::barrier`], then releases them.
    pub fn barrier(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for l in &mut self.links {
            l.expect(ARRIVE, deadline, "waiting at a barrier")?;
        }
        for l in &mut self.links {
            l.send(GO, &[])?;
        }
        Ok(())
    }
}

impl Link {
    /// A worker's side of [`Lead::barrier`].
    pub fn barrier(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        self.send(ARRIVE, &[])?;
        self.expect(GO, deadline, "waiting at a barrier").map(drop)
    }
}
