//! One process per GPU: a node's launcher starts its ranks as copies of this program with
//! torchrun's variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), and watches them: the first that fails ends the others and the launch
//! with its rank named, so a dead rank never leaves the job hanging.

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
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(places.len());
    for p in places {
        let spawned = Command::new(program).args(args).envs(p.env()).spawn();
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
        let mut running = false;
        let mut failure: Option<(usize, ExitStatus)> = None;
        for (rank, c) in children.iter_mut() {
            match c.try_wait() {
                Ok(Some(s)) if !s.success() => {
                    failure.get_or_insert((*rank, s));
                }
                Ok(Some(_)) => {}
                Ok(None) => running = true,
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
