use std::collections::HashMap;
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use super::codec::{Reader, Writer};
use super::rendezvous::{join, lead_on, MESSAGE};
use super::*;

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn local(port: u16) -> Master {
    Master {
        addr: "127.0.0.1".into(),
        port,
    }
}

#[test]
fn one_rank_is_single_and_one_node_launches_its_ranks() {
    let none = env_of(&[]);
    let flags = LaunchFlags::default();
    assert_eq!(resolve(1, &flags, &none), Ok(Role::Single));
    assert_eq!(
        resolve(4, &flags, &none),
        Ok(Role::Launcher {
            first: 0,
            local: 4,
            world: 4,
            master: local(DEFAULT_MASTER_PORT)
        })
    );
}

#[test]
fn torchrun_variables_make_a_rank_and_flags_win_over_them() {
    let env = env_of(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
    ]);
    let place = |addr: &str, port| {
        Ok(Role::Rank(RankPlace {
            rank: 5,
            world: 8,
            local_rank: 1,
            local_world: 8,
            master: Master {
                addr: addr.into(),
                port,
            },
        }))
    };
    assert_eq!(
        resolve(8, &LaunchFlags::default(), &env),
        place("10.0.0.1", 1234)
    );
    let flags = LaunchFlags {
        master_addr: Some("head".into()),
        master_port: Some(777),
        ..Default::default()
    };
    assert_eq!(resolve(8, &flags, &env), place("head", 777));
    // The env of a launched rank round-trips.
    let Ok(Role::Rank(p)) = resolve(8, &flags, &env) else {
        panic!("a rank")
    };
    let vars: Vec<(String, String)> = p.env().into_iter().map(|(k, v)| (k.into(), v)).collect();
    let again = move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(
        resolve(8, &LaunchFlags::default(), &again),
        place("head", 777)
    );
}

#[test]
fn local_rank_defaults_to_the_rank_on_its_node() {
    let env = env_of(&[("RANK", "6"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "h")]);
    let flags = LaunchFlags {
        nnodes: Some(2),
        ..Default::default()
    };
    match resolve(8, &flags, &env) {
        Ok(Role::Rank(p)) => assert_eq!((p.rank, p.local_rank), (6, 2)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn several_nodes_launch_their_share() {
    let flags = LaunchFlags {
        nnodes: Some(2),
        node_rank: Some(1),
        master_addr: Some("leader.svc".into()),
        master_port: None,
    };
    assert_eq!(
        resolve(16, &flags, &env_of(&[])),
        Ok(Role::Launcher {
            first: 8,
            local: 8,
            world: 16,
            master: Master {
                addr: "leader.svc".into(),
                port: DEFAULT_MASTER_PORT
            }
        })
    );
}

#[test]
fn contradictions_are_named() {
    let err = |world, flags: LaunchFlags, env: &[(&str, &str)]| match resolve(
        world,
        &flags,
        &env_of(env),
    ) {
        Err(BootstrapError::Settings(m)) => m,
        other => panic!("{other:?}"),
    };
    let two = |node| LaunchFlags {
        nnodes: Some(2),
        node_rank: node,
        master_addr: Some("h".into()),
        master_port: None,
    };
    assert!(err(
        4,
        LaunchFlags {
            nnodes: Some(2),
            node_rank: Some(0),
            ..Default::default()
        },
        &[]
    )
    .contains("--master-addr"));
    assert!(err(4, two(None), &[]).contains("--node-rank"));
    assert!(err(4, two(Some(2)), &[]).contains("--node-rank 2"));
    assert!(err(
        6,
        LaunchFlags {
            nnodes: Some(4),
            ..Default::default()
        },
        &[]
    )
    .contains("split"));
    assert!(err(
        4,
        LaunchFlags::default(),
        &[("RANK", "1"), ("WORLD_SIZE", "2")]
    )
    .contains("WORLD_SIZE=2"));
    assert!(err(4, LaunchFlags::default(), &[("RANK", "1")]).contains("WORLD_SIZE"));
    assert!(err(
        4,
        LaunchFlags::default(),
        &[("RANK", "x"), ("WORLD_SIZE", "4")]
    )
    .contains("RANK"));
    assert!(err(
        4,
        LaunchFlags::default(),
        &[("RANK", "4"), ("WORLD_SIZE", "4")]
    )
    .contains("RANK=4"));
    assert!(err(4, two(Some(0)), &[("RANK", "3"), ("WORLD_SIZE", "4")]).contains("node 1"));
    assert!(err(2, LaunchFlags::default(), &[("MASTER_PORT", "70000")]).contains("MASTER_PORT"));
}

/// A listener on a free loopback port.
fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

const T: Duration = Duration::from_secs(10);

#[test]
fn ranks_meet_get_the_id_pass_barriers_and_exchange_messages() {
    let (l, port) = listener();
    let world = 4;
    let workers: Vec<_> = (1..world)
        .map(|r| {
            thread::spawn(move || {
                let (mut link, id) = join("127.0.0.1", port, r, world, T).expect("join");
                link.barrier(T).expect("barrier");
                let (kind, body) = link.recv(None, "waiting for a job").expect("job");
                assert_eq!(kind, MESSAGE);
                let mut reply = body;
                reply.push(r as u8);
                link.send(MESSAGE, &reply).expect("reply");
                id
            })
        })
        .collect();
    let id: Vec<u8> = (0..128).map(|i| i as u8).collect();
    let mut lead = lead_on(l, world, &id, T).expect("lead");
    lead.barrier(T).expect("barrier");
    for link in lead.links() {
        link.send(MESSAGE, b"step").expect("send");
    }
    for link in lead.links() {
        let (_, body) = link
            .recv(Some(Instant::now() + T), "a reply")
            .expect("reply");
        assert_eq!(body, [b's', b't', b'e', b'p', link.peer() as u8]);
    }
    for w in workers {
        assert_eq!(w.join().expect("worker"), id);
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_by_name() {
    let (l, port) = listener();
    let joined = thread::spawn(move || join("127.0.0.1", port, 1, 3, T));
    let start = Instant::now();
    let e = lead_on(l, 3, b"id", Duration::from_millis(300)).expect_err("rank 2 is missing");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(&e, BootstrapError::Timeout(m) if m.contains("rank(s) 2 ")),
        "{e}"
    );
    // The lead has gone: the waiting rank learns it instead of hanging.
    let e = joined.join().expect("thread").expect_err("no welcome");
    assert!(matches!(e, BootstrapError::PeerClosed(0, _)), "{e}");
}

#[test]
fn joining_without_a_lead_times_out_naming_the_address() {
    let (l, port) = listener();
    drop(l);
    let e = join("127.0.0.1", port, 1, 2, Duration::from_millis(200)).expect_err("nobody");
    assert!(
        matches!(&e, BootstrapError::Timeout(m) if m.contains(&format!("127.0.0.1:{port}"))),
        "{e}"
    );
}

#[test]
fn a_rank_that_dies_is_named() {
    let (l, port) = listener();
    let world = 3;
    let workers: Vec<_> = (1..world)
        .map(|r| {
            thread::spawn(move || {
                let (mut link, _) = join("127.0.0.1", port, r, world, T).expect("join");
                if r == 2 {
                    // Dies: its end closes without a barrier.
                    link.close();
                    return;
                }
                // Rank 1 waits for the lead, which gives up: it learns so.
                let _ = link.barrier(T);
            })
        })
        .collect();
    let mut lead = lead_on(l, world, b"id", T).expect("lead");
    let e = lead.barrier(T).expect_err("rank 2 died");
    assert!(matches!(e, BootstrapError::PeerClosed(2, _)), "{e}");
    drop(lead);
    workers.into_iter().for_each(|w| w.join().expect("worker"));
}

#[test]
fn wrong_world_and_twice_the_same_rank_are_refused() {
    let (l, port) = listener();
    let w = thread::spawn(move || join("127.0.0.1", port, 1, 3, T));
    let e = lead_on(l, 2, b"id", T).expect_err("world differs");
    assert!(
        matches!(&e, BootstrapError::Protocol(m) if m.contains("3 ranks")),
        "{e}"
    );
    let _ = w.join();

    let (l, port) = listener();
    let ws: Vec<_> = (0..2)
        .map(|_| thread::spawn(move || join("127.0.0.1", port, 1, 3, T)))
        .collect();
    let e = lead_on(l, 3, b"id", T).expect_err("rank 1 twice");
    assert!(
        matches!(&e, BootstrapError::Protocol(m) if m.contains("twice")),
        "{e}"
    );
    ws.into_iter().for_each(|w| drop(w.join()));
}

#[test]
fn codec_round_trips_and_names_bad_messages() {
    let mut w = Writer::new();
    w.u8(7)
        .bool(true)
        .u32(9)
        .usize(1 << 40)
        .f32(-0.5)
        .u32s(&[1, 2, 3])
        .str("héllo");
    let bytes = w.finish();
    let mut r = Reader::new(&bytes, "test");
    assert_eq!(r.u8().ok(), Some(7));
    assert_eq!(r.bool().ok(), Some(true));
    assert_eq!(r.u32().ok(), Some(9));
    assert_eq!(r.usize().ok(), Some(1 << 40));
    assert_eq!(r.f32().map(f32::to_bits).ok(), Some((-0.5f32).to_bits()));
    assert_eq!(r.u32s().ok(), Some(vec![1, 2, 3]));
    assert_eq!(r.str().ok().as_deref(), Some("héllo"));
    assert!(r.end().is_ok());

    // The string's last bytes are missing.
    let mut cut = Reader::new(&bytes[..bytes.len() - 2], "test");
    let (_, _, _, _, _, _) = (
        cut.u8(),
        cut.bool(),
        cut.u32(),
        cut.usize(),
        cut.f32(),
        cut.u32s(),
    );
    assert!(matches!(cut.str(), Err(BootstrapError::Protocol(m)) if m.contains("list of")));
    let mut short = Reader::new(&bytes[..3], "test");
    assert!(matches!(short.u32s(), Err(BootstrapError::Protocol(m)) if m.contains("test")));
    let mut huge = Writer::new();
    huge.usize(usize::MAX / 2);
    let huge = huge.finish();
    assert!(Reader::new(&huge, "test").u32s().is_err());
    let mut left = Reader::new(&bytes, "test");
    let _ = left.u8();
    assert!(matches!(left.end(), Err(BootstrapError::Protocol(m)) if m.contains("left over")));
}
