//! The in-process collectives on the CPU backend: every operation against a serial
//! computation, the same bits on every rank, mismatched calls and missing ranks as errors
//! within the deadline (never a hang).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kimi_cpu::{CpuBackend, CpuTensor};
use kimi_ops::{Backend, Collective, ThreadComm, ThreadGroup};

/// Runs `f(rank, comm)` on `world` threads and returns their results by rank.
fn on_ranks<R: Send + 'static>(
    group: &Arc<ThreadGroup>,
    world: usize,
    f: impl Fn(usize, ThreadComm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (f, comm) = (Arc::clone(&f), group.comm(r));
            std::thread::spawn(move || f(r, comm))
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
    for world in [1usize, 2, 3, 4] {
        let group = ThreadGroup::new(world);
        let results = on_ranks(&group, world, move |r, comm| {
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
            assert_eq!(reduced, want, "all_reduce_sum, world {world}, rank {r}");
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
            assert_eq!(broadcast, values(world - 1, 5), "broadcast");
        }
    }
}

#[test]
fn a_missing_rank_is_an_error_naming_it_within_the_deadline() {
    let group = ThreadGroup::with_timeout(3, Duration::from_millis(300));
    let start = Instant::now();
    // Rank 2 never calls.
    let results = on_ranks(&group, 2, |_, comm| {
        let be = CpuBackend::new();
        let mut t = tensor(&[2], vec![1.0, 2.0]);
        comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for r in results {
        let e = r.unwrap_err();
        assert!(e.contains("all_reduce_sum") || e.contains("aborted"), "{e}");
    }
    // The group stays failed: a later call errors at once.
    let be = CpuBackend::new();
    let mut t = tensor(&[2], vec![1.0, 2.0]);
    let e = group
        .comm(0)
        .all_reduce_sum(&be, &mut t)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank(s) 2 did not arrive"), "{e}");
}

#[test]
fn mismatched_operations_and_shapes_are_errors_on_every_rank() {
    let group = ThreadGroup::with_timeout(2, Duration::from_secs(10));
    let results = on_ranks(&group, 2, |r, comm| {
        let be = CpuBackend::new();
        let mut t = tensor(&[r + 1], vec![1.0; r + 1]);
        comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(
            e.contains("rank 0 passed [1, 1] but rank 1 passed [1, 2]") || e.contains("aborted"),
            "{e}"
        );
    }
    let group = ThreadGroup::with_timeout(2, Duration::from_secs(10));
    let results = on_ranks(&group, 2, |r, comm| {
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
        "{results:?}"
    );
}

#[test]
fn an_aborting_rank_releases_the_others_at_once() {
    let group = ThreadGroup::new(2);
    let start = Instant::now();
    let results = on_ranks(&group, 2, |r, comm| {
        let be = CpuBackend::new();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(50));
            Collective::<CpuBackend>::abort(&comm, "the model failed to load");
            return Err("aborted".to_string());
        }
        let mut t = tensor(&[2], vec![1.0; 2]);
        comm.all_reduce_sum(&be, &mut t).map_err(|e| e.to_string())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "waited for the timeout"
    );
    let e = results[0].as_ref().unwrap_err();
    assert!(e.contains("rank 1: the model failed to load"), "{e}");
}
