//! The collectives of the CPU backend, for ranks that are threads (`ThreadGroup`) and for
//! ranks that are processes meeting in shared memory (`ShmComm`, joined here from threads:
//! they meet only through the files): every operation against a serial computation, the
//! same bits on every rank, mismatched calls and missing ranks as errors within the
//! deadline (never a hang), an abort releasing the others at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kimi_cpu::{CpuBackend, CpuTensor};
use kimi_ops::{Backend, Collective, ShmComm, ShmGroup, ThreadGroup};

type Comm = Box<dyn Collective<CpuBackend>>;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Threads,
    SharedMemory,
}

const KINDS: [Kind; 2] = [Kind::Threads, Kind::SharedMemory];

/// Every rank's handle on a new group of `world` ranks.
fn group(kind: Kind, world: usize, timeout: Duration) -> Vec<Comm> {
    match kind {
        Kind::Threads => {
            let group = ThreadGroup::with_timeout(world, timeout);
            (0..world)
                .map(|r| Box::new(group.comm(r)) as Comm)
                .collect()
        }
        Kind::SharedMemory => {
            let made = ShmGroup::create(world).unwrap();
            let name = made.name().to_string();
            let joins: Vec<_> = (0..world)
                .map(|r| {
                    let name = name.clone();
                    std::thread::spawn(move || ShmComm::join(&name, r, world, timeout).unwrap())
                })
                .collect();
            joins
                .into_iter()
                .map(|h| Box::new(h.join().unwrap()) as Comm)
                .collect()
        }
    }
}

/// Runs `f(rank, comm)` on a thread per comm and returns their results by rank.
fn on_ranks<R: Send + 'static>(
    comms: Vec<Comm>,
    f: impl Fn(usize, &Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let f = Arc::clone(&f);
            std::thread::spawn(move || f(r, &comm))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank `r`'s test values: distinct per rank and position, with fractions whose sums round.
fn values(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (r * 1000 + i) as f32 * 0.1 + 1.0 / 3.0)
        .collect()
}

fn tensor(shape: &[usize], v: Vec<f32>) -> CpuTensor {
    CpuTensor::f32(shape, v).unwrap()
}

#[test]
fn every_operation_matches_a_serial_computation() {
    for (kind, world) in KINDS
        .into_iter()
        .flat_map(|k| [1usize, 2, 3, 4].map(|w| (k, w)))
    {
        let comms = group(kind, world, Duration::from_secs(60));
        let results = on_ranks(comms, move |r, comm| {
            let be = CpuBackend::new();
            // all_reduce_sum: rank order, the same bits everywhere.
            let mut t = tensor(&[3, 4], values(r, 12));
            comm.all_reduce_sum(&be, &mut t).unwrap();
            let reduced = be.to_f32(&t).unwrap();
            // all_gather_cols of [2, r + 1] parts.
            let part = tensor(&[2, r + 1], values(r, 2 * (r + 1)));
            let cols = comm.all_gather_cols(&be, &part).unwrap();
            let cols = (be.shape(&cols).to_vec(), be.to_f32(&cols).unwrap());
            // all_gather_rows of [r + 1, 3] parts.
            let part = tensor(&[r + 1, 3], values(r, 3 * (r + 1)));
            let rows = comm.all_gather_rows(&be, &part).unwrap();
            let rows = (be.shape(&rows).to_vec(), be.to_f32(&rows).unwrap());
            // reduce_scatter_rows of [2 * world, 2].
            let t = tensor(&[2 * world, 2], values(r, 4 * world));
            let scattered = be
                .to_f32(&comm.reduce_scatter_rows(&be, &t).unwrap())
                .unwrap();
            // all_to_all_rows: rank r sends j + 1 rows of 2 to rank j.
            let parts: Vec<CpuTensor> = (0..world)
                .map(|j| tensor(&[j + 1, 2], values(r * 10 + j, 2 * (j + 1))))
                .collect();
            let received: Vec<Vec<f32>> = comm
                .all_to_all_rows(&be, &parts)
                .unwrap()
                .iter()
                .map(|t| be.to_f32(t).unwrap())
                .collect();
            // broadcast from the last rank.
            let mut t = tensor(&[5], values(r, 5));
            comm.broadcast(&be, &mut t, world - 1).unwrap();
            let broadcast = be.to_f32(&t).unwrap();
            (reduced, cols, rows, scattered, received, broadcast)
        });
        for (r, (reduced, cols, rows, scattered, received, broadcast)) in
            results.into_iter().enumerate()
        {
            let mut want = values(0, 12);
            for s in 1..world {
                for (w, v) in want.iter_mut().zip(values(s, 12)) {
                    *w += v;
                }
            }
            assert_eq!(
                reduced, want,
                "{kind:?}: all_reduce_sum, world {world}, rank {r}"
            );
            let total_cols: usize = (1..=world).sum();
            let mut want = Vec::new();
            for row in 0..2 {
                for s in 0..world {
                    let v = values(s, 2 * (s + 1));
                    want.extend_from_slice(&v[row * (s + 1)..(row + 1) * (s + 1)]);
                }
            }
            assert_eq!(cols, (vec![2, total_cols], want), "all_gather_cols");
            let want: Vec<f32> = (0..world).flat_map(|s| values(s, 3 * (s + 1))).collect();
            assert_eq!(rows, (vec![total_cols, 3], want), "all_gather_rows");
            let mut want = values(0, 4 * world)[r * 4..(r + 1) * 4].to_vec();
            for s in 1..world {
                for (w, v) in want
                    .iter_mut()
                    .zip(&values(s, 4 * world)[r * 4..(r + 1) * 4])
                {
                    *w += v;
                }
            }
            assert_eq!(scattered, want, "reduce_scatter_rows");
            let want: Vec<Vec<f32>> = (0..world)
                .map(|s| values(s * 10 + r, 2 * (r + 1)))
                .collect();
            assert_eq!(received, want, "all_to_all_rows");
            assert_eq!(broadcast, values(world - 1, 5), "{kind:?}: broadcast");
        }
    }
}

#[test]
fn a_missing_rank_is_an_error_naming_it_within_the_deadline() {
    for kind in KINDS {
        let mut comms = group(kind, 3, Duration::from_millis(300));
        // Rank 2 never calls.
        let absent = comms.pop().unwrap();
        let start = Instant::now();
        let results = on_ranks(comms, move |r, comm| {
            let be = CpuBackend::new();
            let mut t = tensor(&[2], vec![1.0, 2.0]);
            let result = comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string());
            if r == 0 {
                // The group stays failed: a later call errors at once.
                let e = comm.all_reduce_sum(&be, &mut t).unwrap_err().to_string();
                return result.and(Err(e));
            }
            result
        });
        assert!(start.elapsed() < Duration::from_secs(5), "{kind:?}");
        for r in &results[1..] {
            let e = r.as_ref().unwrap_err();
            assert!(
                e.contains("all_reduce_sum") || e.contains("aborted"),
                "{kind:?}: {e}"
            );
        }
        let e = results[0].as_ref().unwrap_err();
        assert!(e.contains("rank(s) 2 did not arrive"), "{kind:?}: {e}");
        drop(absent);
    }
}

#[test]
fn mismatched_operations_and_shapes_are_errors_on_every_rank() {
    for kind in KINDS {
        let comms = group(kind, 2, Duration::from_secs(10));
        let results = on_ranks(comms, |r, comm| {
            let be = CpuBackend::new();
            let mut t = tensor(&[r + 1], vec![1.0; r + 1]);
            comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
        });
        for r in results {
            let e = r.unwrap_err();
            assert!(
                e.contains("rank 0 passed [1, 1] but rank 1 passed [1, 2]")
                    || e.contains("aborted"),
                "{kind:?}: {e}"
            );
        }
        let comms = group(kind, 2, Duration::from_secs(10));
        let results = on_ranks(comms, |r, comm| {
            let be = CpuBackend::new();
            let mut t = tensor(&[2], vec![1.0; 2]);
            if r == 0 {
                comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
            } else {
                comm.broadcast(&be, &mut t, 0).map_err(|e| e.to_string())
            }
        });
        assert!(
            results.iter().all(|r| r
                .as_ref()
                .is_err_and(|e| e.contains("mismatch") || e.contains("aborted"))),
            "{kind:?}: {results:?}"
        );
    }
}

#[test]
fn an_aborting_rank_releases_the_others_at_once() {
    for kind in KINDS {
        let comms = group(kind, 2, Duration::from_secs(600));
        let start = Instant::now();
        let results = on_ranks(comms, |r, comm| {
            let be = CpuBackend::new();
            if r == 1 {
                std::thread::sleep(Duration::from_millis(50));
                comm.abort("the model failed to load");
                return Err("aborted".to_string());
            }
            let mut t = tensor(&[2], vec![1.0; 2]);
            comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
        });
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{kind:?}: waited for the timeout"
        );
        let e = results[0].as_ref().unwrap_err();
        assert!(
            e.contains("rank 1: the model failed to load"),
            "{kind:?}: {e}"
        );
    }
}

#[test]
fn shared_memory_deposits_grow_past_their_first_page_and_leave_no_files() {
    let made = ShmGroup::create(2).unwrap();
    let name = made.name().to_string();
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let comms = {
        let joins: Vec<_> = (0..2)
            .map(|r| {
                let name = name.clone();
                std::thread::spawn(move || {
                    ShmComm::join(&name, r, 2, Duration::from_secs(30)).unwrap()
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|h| Box::new(h.join().unwrap()) as Comm)
            .collect::<Vec<_>>()
    };
    let leftovers = || {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
            .count()
    };
    assert_eq!(leftovers(), 0, "the names go once every rank has joined");
    // 1, 1,000 then 300,000 values: the files grow (and the other rank remaps them).
    let results = on_ranks(comms, |r, comm| {
        let be = CpuBackend::new();
        [1usize, 1000, 300_000, 7]
            .into_iter()
            .map(|n| {
                let mut t = tensor(&[n], values(r, n));
                comm.all_reduce_sum(&be, &mut t).unwrap();
                be.to_f32(&t).unwrap()
            })
            .collect::<Vec<_>>()
    });
    for n_results in &results {
        for v in n_results {
            let n = v.len();
            let want: Vec<f32> = values(0, n)
                .iter()
                .zip(values(1, n))
                .map(|(a, b)| a + b)
                .collect();
            assert_eq!(v, &want, "{n} values");
        }
    }
    drop(made);
}

#[test]
fn joining_a_group_that_is_not_there_names_it() {
    let e = ShmComm::join("kimi-collective-none", 1, 2, Duration::from_secs(1))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("kimi-collective-none") && e.contains("one node"),
        "{e}"
    );
    let e = ShmComm::join("../etc/passwd", 1, 2, Duration::from_secs(1))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a group's name"), "{e}");
}
