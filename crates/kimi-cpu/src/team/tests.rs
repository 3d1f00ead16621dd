use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use super::{parts, Team, DEFAULT_SPIN};

fn teams() -> impl Iterator<Item = Team> {
    [1, 2, 3, 5].into_iter().map(|n| Team::new(n, DEFAULT_SPIN))
}

fn counters(n: usize) -> Vec<AtomicUsize> {
    (0..n).map(|_| AtomicUsize::new(0)).collect()
}

/// Spins until `cond` holds; fails the test after a few seconds.
fn wait_until(cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out");
        std::hint::spin_loop();
    }
}

#[test]
fn every_index_runs_exactly_once_per_section() {
    for team in teams() {
        for tasks in [0, 1, 2, team.threads(), 7, 100] {
            let counts = counters(tasks);
            for s in 0..300 {
                team.run(tasks, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                // Every count is up to date when `run` returns.
                for c in &counts {
                    assert_eq!(c.load(Ordering::Relaxed), s + 1);
                }
            }
        }
    }
}

#[test]
fn sections_use_the_workers() {
    let team = Team::new(3, DEFAULT_SPIN);
    // Each task waits for all three to start, so three threads must take part.
    let started = AtomicUsize::new(0);
    let ids = Mutex::new(HashSet::new());
    team.run(3, &|_| {
        ids.lock().unwrap().insert(thread::current().id());
        started.fetch_add(1, Ordering::SeqCst);
        wait_until(|| started.load(Ordering::SeqCst) == 3);
    });
    let ids = ids.into_inner().unwrap();
    assert_eq!(ids.len(), 3);
    assert!(ids.contains(&thread::current().id()));
}

#[test]
fn the_caller_does_all_the_work_of_workers_that_do_not_show_up() {
    let team = Team::new(3, DEFAULT_SPIN);
    let me = thread::current().id();
    {
        let _stalled = team.shared.stall.lock().unwrap();
        for _ in 0..100 {
            let threads = Mutex::new(Vec::new());
            team.run(8, &|_| threads.lock().unwrap().push(thread::current().id()));
            assert_eq!(threads.into_inner().unwrap(), vec![me; 8]);
        }
    }
    // Workers that were late (still holding an old generation) catch up and help again.
    let started = AtomicUsize::new(0);
    team.run(3, &|_| {
        started.fetch_add(1, Ordering::SeqCst);
        wait_until(|| started.load(Ordering::SeqCst) == 3);
    });
}

#[test]
fn many_sequential_sections_see_each_others_writes() {
    for team in teams() {
        let mut data = vec![0u64; 1000];
        let rounds = 5000u64;
        for round in 0..rounds {
            team.for_each_part(&mut data, 1, 8, |_, part| {
                for v in part {
                    *v += round;
                }
            });
        }
        let want = (0..rounds).sum::<u64>();
        assert!(
            data.iter().all(|&v| v == want),
            "{} threads",
            team.threads()
        );
    }
}

#[test]
fn a_nested_section_runs_serially_on_the_calling_thread() {
    let team = Team::new(3, DEFAULT_SPIN);
    let inner_runs = AtomicUsize::new(0);
    team.run(3, &|_| {
        let me = thread::current().id();
        let seen = Mutex::new(Vec::new());
        team.run(4, &|j| {
            seen.lock().unwrap().push((j, thread::current().id()))
        });
        let seen = seen.into_inner().unwrap();
        // All tasks, in order, on this thread.
        assert_eq!(seen, (0..4).map(|j| (j, me)).collect::<Vec<_>>());
        assert_eq!(team.map(5, |t| t * 2), vec![0, 2, 4, 6, 8]);
        inner_runs.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(inner_runs.load(Ordering::Relaxed), 3);
}

#[test]
fn panics_propagate_and_the_team_survives() {
    for team in teams() {
        let tasks = 6;
        for bad in 0..tasks {
            let ran = AtomicUsize::new(0);
            let result = catch_unwind(AssertUnwindSafe(|| {
                team.run(tasks, &|i| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    if i == bad {
                        panic!("task {i} failed");
                    }
                })
            }));
            let payload = result.expect_err("the panic reaches the caller");
            let msg = payload
                .downcast_ref::<String>()
                .expect("a formatted message");
            assert_eq!(msg, &format!("task {bad} failed"));
            // The section had ended: no task is still running.
            let after = ran.load(Ordering::Relaxed);
            thread::sleep(Duration::from_millis(1));
            assert_eq!(ran.load(Ordering::Relaxed), after);
        }
        // Every task panicking: one of the payloads comes back.
        let all = catch_unwind(AssertUnwindSafe(|| team.run(tasks, &|_| panic!("all"))));
        assert!(all.is_err());
        // Still works afterwards.
        let counts = counters(tasks);
        team.run(tasks, &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
}

#[test]
fn a_panic_in_map_propagates() {
    let team = Team::new(2, DEFAULT_SPIN);
    let r = catch_unwind(AssertUnwindSafe(|| {
        team.map(10, |t| {
            assert!(t != 7, "task 7");
            t
        })
    }));
    assert!(r.is_err());
    assert_eq!(team.map(3, |t| t + 1), vec![1, 2, 3]);
}

#[test]
fn one_thread_runs_everything_on_the_caller() {
    let team = Team::new(1, DEFAULT_SPIN);
    assert_eq!(team.threads(), 1);
    let me = thread::current().id();
    let calls = Mutex::new(Vec::new());
    team.run(3, &|i| {
        calls.lock().unwrap().push((i, thread::current().id()))
    });
    assert_eq!(calls.into_inner().unwrap(), vec![(0, me), (1, me), (2, me)]);
    assert_eq!(team.map(4, |t| t * t), vec![0, 1, 4, 9]);
    let mut data = vec![0; 10];
    team.for_each_part(&mut data, 2, 1, |first, part| {
        assert_eq!((first, part.len()), (0, 10));
        part.fill(1);
    });
    assert_eq!(data, vec![1; 10]);
    // Zero is treated as one.
    assert_eq!(Team::new(0, DEFAULT_SPIN).threads(), 1);
}

#[test]
fn parked_workers_wake_for_the_next_section() {
    // No spinning: workers park right after each section.
    let team = Team::new(3, Duration::ZERO);
    for _ in 0..20 {
        thread::sleep(Duration::from_millis(1));
        // Only a woken worker can start the second and third tasks.
        let started = AtomicUsize::new(0);
        team.run(3, &|_| {
            started.fetch_add(1, Ordering::SeqCst);
            wait_until(|| started.load(Ordering::SeqCst) == 3);
        });
    }
    // Back to back, racing the workers' parking.
    let total = AtomicUsize::new(0);
    for _ in 0..5000 {
        team.run(3, &|_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
    }
    assert_eq!(total.load(Ordering::Relaxed), 15_000);
}

#[test]
fn announced_work_wakes_parked_workers_and_keeps_them_spinning() {
    // No spin budget: without an announcement workers park right after each section.
    let team = Team::new(3, Duration::ZERO);
    team.run(3, &|_| {});
    let parked = || team.shared.sleepers.load(Ordering::SeqCst);
    wait_until(|| parked() == 2);
    team.expect_work(Duration::from_secs(30));
    wait_until(|| parked() == 0);
    // Still spinning well past the (zero) budget, and sections run as before.
    thread::sleep(Duration::from_millis(20));
    assert_eq!(parked(), 0);
    let total = AtomicUsize::new(0);
    team.run(3, &|_| {
        total.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(total.load(Ordering::Relaxed), 3);
    // Once the announced time has passed they park again.
    let team = Team::new(3, Duration::ZERO);
    team.expect_work(Duration::from_millis(5));
    thread::sleep(Duration::from_millis(10));
    wait_until(|| team.shared.sleepers.load(Ordering::SeqCst) == 2);
}

#[test]
fn concurrent_callers_each_get_every_task() {
    let team = Team::new(3, DEFAULT_SPIN);
    thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                for _ in 0..1000 {
                    let counts = counters(5);
                    team.run(5, &|i| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    });
                    assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
                }
            });
        }
    });
}

#[test]
fn parts_cover_items_in_aligned_contiguous_ranges() {
    for items in [0, 1, 7, 16, 17, 100, 192, 576, 1536, 49152] {
        for align in [1, 4, 16] {
            for threads in 1..6 {
                let ranges = parts(items, align, threads);
                let ctx = format!("{items} {align} {threads}: {ranges:?}");
                assert_eq!(ranges.first().map_or(0, |r| r.start), 0, "{ctx}");
                assert_eq!(ranges.last().map_or(0, |r| r.end), items, "{ctx}");
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "{ctx}");
                }
                for r in &ranges {
                    assert!(!r.is_empty() && r.start.is_multiple_of(align), "{ctx}");
                }
                // One large part per thread, even up to one step, then single steps.
                let large = threads.min(ranges.len());
                let lens: Vec<_> = ranges[..large].iter().map(|r| r.len()).collect();
                let (lo, hi) = (
                    lens.iter().min().unwrap_or(&0),
                    lens.iter().max().unwrap_or(&0),
                );
                assert!(hi - lo <= align, "{ctx}");
                assert!(ranges[large..].iter().all(|r| r.len() <= align), "{ctx}");
                assert!(ranges.len() <= 9 * threads, "{ctx}");
                if threads == 1 {
                    assert!(ranges.len() <= 1, "{ctx}");
                }
            }
        }
    }
    // Decode-sized matmuls: 576 rows in 16-row steps over two threads.
    assert_eq!(parts(576, 16, 2)[..3], [0..256, 256..512, 512..528]);
}

#[test]
fn for_each_part_hands_out_every_item_once() {
    for team in teams() {
        for (unit, items, align) in [(3, 101, 4), (1, 1000, 16), (2, 5, 1)] {
            let mut data = vec![0usize; unit * items];
            let firsts = Mutex::new(Vec::new());
            team.for_each_part(&mut data, unit, align, |first, part| {
                assert_eq!(part.len() % unit, 0);
                firsts.lock().unwrap().push(first);
                for (j, v) in part.iter_mut().enumerate() {
                    *v += first * unit + j + 1;
                }
            });
            assert_eq!(data, (1..=unit * items).collect::<Vec<_>>());
            let mut firsts = firsts.into_inner().unwrap();
            firsts.sort();
            let want: Vec<_> = parts(items, align, team.threads())
                .iter()
                .map(|r| r.start)
                .collect();
            assert_eq!(firsts, want);
        }
    }
}

#[test]
fn map_keeps_task_order() {
    for team in teams() {
        let out = team.map(1000, |t| t * 3);
        assert_eq!(out, (0..1000).map(|t| t * 3).collect::<Vec<_>>());
        assert!(team.map(0, |t| t).is_empty());
        let mut data: Vec<u32> = (0..50).collect();
        let sums = team.map_chunks_mut(&mut data, 7, |i, c| {
            c.iter_mut().for_each(|v| *v += 1);
            (i, c.iter().sum::<u32>())
        });
        assert_eq!(data, (1..=50).collect::<Vec<_>>());
        assert_eq!(sums.len(), 8);
        assert_eq!(sums[7], (7, 50));
    }
}

#[test]
fn workers_flush_subnormals_to_zero() {
    use std::hint::black_box;
    let team = Team::new(2, DEFAULT_SPIN);
    let me = thread::current().id();
    let started = AtomicUsize::new(0);
    let results: Mutex<Vec<(ThreadId, f32)>> = Mutex::new(Vec::new());
    team.run(2, &|_| {
        let v = black_box(f32::MIN_POSITIVE) * black_box(0.5);
        results.lock().unwrap().push((thread::current().id(), v));
        // Both tasks run at once: one of them on the worker.
        started.fetch_add(1, Ordering::SeqCst);
        wait_until(|| started.load(Ordering::SeqCst) == 2);
    });
    let results = results.into_inner().unwrap();
    let on_worker: Vec<f32> = results
        .iter()
        .filter(|(id, _)| *id != me)
        .map(|r| r.1)
        .collect();
    assert_eq!(on_worker.len(), 1);
    if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        assert_eq!(on_worker, vec![0.0]);
    }
}
