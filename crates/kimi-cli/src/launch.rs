//! One process per GPU: a node's launcher starts its ranks as copies of this program with
//! torchrun's variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), and watches them: the first that fails ends the others and the launch
//! with its rank named, so a dead rank never leaves the job hanging.
//!
//! Signals: the ranks share the launcher's process group, so a terminal's Ctrl-C reaches
//! every one of them (and a rank 0 that reads the terminal, as `chat` does, is in the
//! foreground). A SIGTERM sent to the launcher alone (a container's PID 1, as Docker and
//! Kubernetes stop it) is passed to its ranks. Rank 0 acts on either (`serve` drains, a
//! later one exits now); the other ranks ignore both ([`ignore_signals`]) and end when rank
//! 0 ends the job; the launcher waits for them. A launcher that dies takes its ranks with
//! it (SIGKILL, on Linux).

use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::Context;
use kimi_ops::bootstrap::{Master, RankPlace};

/// The places of a node's ranks `first..first + local` of `world`.
pub fn node_places(first: usize, local: usize, world: usize, master: &Master) -> Vec<RankPlace> {
    (0..local)
        .map(|i| RankPlace {
            rank: first + i,
            world,
            local_rank: i,
            local_world: local,
            master: master.clone(),
        })
        .collect()
}

/// Starts `program args` once per place, with the place's variables, and waits for all:
/// `Ok` when every rank ends well; else, as soon as one fails, the others are killed and
/// the error names it.
pub fn run_ranks(
    program: &std::path::Path,
    args: &[String],
    places: &[RankPlace],
) -> anyhow::Result<()> {
    let signals = watch_signals();
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(places.len());
    for p in places {
        let mut command = Command::new(program);
        command.args(args).envs(p.env());
        os::end_with_parent(&mut command);
        let spawned = command.spawn();
        match spawned {
            Ok(c) => children.push((p.rank, c)),
            Err(e) => {
                stop(&mut children);
                return Err(e)
                    .with_context(|| format!("starting rank {} ({})", p.rank, program.display()));
            }
        }
    }
    loop {
        let pending: Vec<i32> = signals.try_iter().collect();
        let mut running = false;
        let mut failure: Option<(usize, ExitStatus)> = None;
        for (rank, c) in children.iter_mut() {
            match c.try_wait() {
                Ok(Some(s)) if !s.success() => {
                    failure.get_or_insert((*rank, s));
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    running = true;
                    // Only to a rank still running: a reaped one's pid may be another's.
                    for &signal in &pending {
                        os::send_signal(c.id(), signal);
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("watching rank {rank}")),
            }
        }
        if let Some((rank, status)) = failure {
            stop(&mut children);
            anyhow::bail!("rank {rank} ended with {status}; the other ranks were stopped");
        }
        if !running {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The SIGTERMs this process gets from now on, to pass on; SIGINT, which a terminal sends
/// the ranks themselves, is swallowed. Neither ends the launcher any more.
fn watch_signals() -> std::sync::mpsc::Receiver<i32> {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, rx) = std::sync::mpsc::channel();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let Ok(runtime) = runtime else {
        return rx;
    };
    // Registered here, before any rank starts, and served on a thread of their own.
    let streams = {
        let _inside = runtime.enter();
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        )
    };
    let (Ok(mut int), Ok(mut term)) = streams else {
        return rx;
    };
    std::thread::spawn(move || {
        runtime.block_on(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => continue,
                    _ = term.recv() => {}
                };
                if tx.send(os::SIGTERM).is_err() {
                    break;
                }
            }
        })
    });
    rx
}

/// A rank other than 0 lets SIGINT and SIGTERM pass: it ends when rank 0 ends the job (or
/// its link to rank 0 closes), so that rank 0 can drain with every rank's help.
pub fn ignore_signals() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let _inside = runtime.enter();
    // The handlers stay for the life of the process once registered.
    let _ = signal(SignalKind::interrupt());
    let _ = signal(SignalKind::terminate());
}

/// The process calls the launcher needs from the OS.
#[allow(unsafe_code)]
mod os {
    pub const SIGTERM: i32 = libc::SIGTERM;

    /// Sends `signal` to process `pid` (one of the launcher's ranks).
    pub fn send_signal(pid: u32, signal: i32) {
        // SAFETY: kill(2) with a child's pid and a valid signal number; no memory involved.
        unsafe {
            libc::kill(pid as libc::pid_t, signal);
        }
    }

    /// The child is killed when the launcher dies (Linux; elsewhere nothing): a rank
    /// other than 0 ignores SIGTERM, and none should outlive the job holding a GPU.
    pub fn end_with_parent(command: &mut std::process::Command) {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            let launcher = std::process::id() as libc::pid_t;
            // SAFETY: prctl(2) and getppid(2) are async-signal-safe, as code between fork
            // and exec must be; nothing is allocated.
            unsafe {
                command.pre_exec(move || {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    // The launcher died before the call: nothing would kill this child.
                    if libc::getppid() != launcher {
                        return Err(std::io::Error::other("the launcher has ended"));
                    }
                    Ok(())
                });
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = command;
    }
}

/// Kills the ranks still running (the launcher's own children) and reaps them.
fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Instant;

    fn master() -> Master {
        Master {
            addr: "127.0.0.1".into(),
            port: 29500,
        }
    }

    #[test]
    fn a_node_gets_its_share_of_ranks() {
        let p = node_places(8, 4, 16, &master());
        let ranks: Vec<(usize, usize)> = p.iter().map(|p| (p.rank, p.local_rank)).collect();
        assert_eq!(ranks, [(8, 0), (9, 1), (10, 2), (11, 3)]);
        assert!(p.iter().all(|p| p.world == 16));
    }

    /// Each rank runs a shell script that reads its variables.
    fn sh(script: &str) -> Vec<String> {
        vec!["-c".into(), script.into()]
    }

    #[test]
    fn ranks_see_their_variables_and_all_ending_well_is_ok() {
        let dir = std::env::temp_dir().join(format!("kimi-launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT > {}/$RANK",
            dir.display()
        );
        run_ranks(
            Path::new("/bin/sh"),
            &sh(&script),
            &node_places(2, 2, 4, &master()),
        )
        .unwrap();
        let read = |r: usize| std::fs::read_to_string(dir.join(r.to_string())).unwrap();
        assert_eq!(read(2).trim(), "2 4 0 127.0.0.1 29500");
        assert_eq!(read(3).trim(), "3 4 1 127.0.0.1 29500");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_is_named() {
        // Rank 1 fails at once; rank 0 would run for a minute.
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60";
        let start = Instant::now();
        let e = run_ranks(
            Path::new("/bin/sh"),
            &sh(script),
            &node_places(0, 2, 2, &master()),
        )
        .expect_err("rank 1 fails");
        assert!(start.elapsed() < Duration::from_secs(10));
        let e = e.to_string();
        assert!(e.contains("rank 1") && e.contains('3'), "{e}");
    }

    #[test]
    fn a_program_that_cannot_start_is_named() {
        let e = run_ranks(
            Path::new("/nonexistent/kimi"),
            &[],
            &node_places(0, 1, 1, &master()),
        )
        .expect_err("no program");
        assert!(format!("{e:#}").contains("starting rank 0"), "{e:#}");
    }
}
