//! The rendezvous between real processes on localhost: this test binary starts copies of
//! itself as ranks 1.. (the variables below make a copy a rank), which meet rank 0 (the
//! test), take its id, pass a barrier and answer a control message; a rank process that
//! dies after joining is named at the next barrier.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kimi_ops::bootstrap::rendezvous::{join, lead_on, MESSAGE};
use kimi_ops::bootstrap::BootstrapError;

const T: Duration = Duration::from_secs(20);
/// Set in a copy started as a rank: `rank,world,port,die`.
const CHILD: &str = "KIMI_RENDEZVOUS_TEST_RANK";

/// A rank process's part: join, then die at once or pass a barrier and echo one message.
fn child(spec: &str) {
    let v: Vec<usize> = spec.split(',').map(|x| x.parse().unwrap()).collect();
    let (rank, world, port, die) = (v[0], v[1], v[2] as u16, v[3] == 1);
    let (mut link, id) = join("127.0.0.1", port, rank, world, T).unwrap();
    assert_eq!(id, b"the-id");
    if die {
        std::process::exit(0);
    }
    if let Err(e) = link.barrier(T) {
        // Rank 0 left (the second part of the test): said, and a failed exit.
        eprintln!("rank {rank}: {e}");
        std::process::exit(2);
    }
    let (kind, mut body) = link.recv(Some(Instant::now() + T), "a message").unwrap();
    assert_eq!(kind, MESSAGE);
    body.push(rank as u8);
    link.send(MESSAGE, &body).unwrap();
}

fn start(test: &str, rank: usize, world: usize, port: u16, die: bool) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, format!("{rank},{world},{port},{}", die as u8))
        .spawn()
        .unwrap()
}

#[test]
fn rank_processes_meet_and_a_dead_one_is_named() {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    // Under qemu user-mode emulation (scripts/arm/test.sh) a copy of this aarch64 binary
    // starts only where qemu is registered with binfmt_misc, which CI's container may not
    // allow (the reason kimi-cli's tests are not run there either); the x86 run covers it.
    if std::env::var_os("KIMI_TEST_EMULATED").is_some() {
        eprintln!("skipped under emulation: starting rank processes needs binfmt_misc");
        return;
    }
    const TEST: &str = "rank_processes_meet_and_a_dead_one_is_named";
    // Three live ranks.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let world = 4;
    let kids: Vec<Child> = (1..world)
        .map(|r| start(TEST, r, world, port, false))
        .collect();
    let mut lead = lead_on(l, world, b"the-id", T).unwrap();
    lead.barrier(T).unwrap();
    for link in lead.links() {
        link.send(MESSAGE, b"hi").unwrap();
    }
    for link in lead.links() {
        let (_, body) = link.recv(Some(Instant::now() + T), "a reply").unwrap();
        assert_eq!(body, [b'h', b'i', link.peer() as u8]);
    }
    for mut k in kids {
        assert!(k.wait().unwrap().success());
    }

    // Rank 2's process ends after joining: the barrier names it.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let world = 3;
    let mut kids: Vec<Child> = (1..world)
        .map(|r| start(TEST, r, world, port, r == 2))
        .collect();
    let mut lead = lead_on(l, world, b"the-id", T).unwrap();
    let e = lead.barrier(T).expect_err("rank 2 died");
    assert!(matches!(e, BootstrapError::PeerClosed(2, _)), "{e}");
    drop(lead);
    // Rank 1 learns that rank 0 left: it fails, it does not hang.
    let codes: Vec<Option<i32>> = kids.iter_mut().map(|k| k.wait().unwrap().code()).collect();
    assert_eq!(codes, [Some(2), Some(0)]);
}
