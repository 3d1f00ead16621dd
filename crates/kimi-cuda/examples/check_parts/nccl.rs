//! `nccl`: every collective of `NcclComm` (NCCL on the GPUs) against `ThreadGroup` (ranks as
//! threads on the CPU), bit for bit: the inputs are small integers, so every sum is exact
//! whatever order NCCL adds in. At world 1 on GPU 0; where more GPUs are visible also at
//! world = their number, one thread per GPU. Then the failure paths: a call after `abort`
//! fails at once, and (with several GPUs) a rank that skips an operation makes the others
//! time out with an error naming it instead of hanging.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kimi_cpu::CpuBackend;
use kimi_cuda::{nccl_version, CudaBackend, NcclComm, NcclId};
use kimi_ops::{Backend, Collective, ThreadGroup};

use super::Res;

/// One case's output on one rank: name, shape, values.
type Out = (String, Vec<usize>, Vec<f32>);

/// A `[rows, cols]` input of rank `rank`, case `salt`: small integers (exact sums).
fn input<B: Backend>(
    be: &B,
    rank: usize,
    salt: usize,
    rows: usize,
    cols: usize,
) -> kimi_ops::Result<B::Tensor> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7 + rank * 13 + salt * 5) % 17) as f32 - 8.0)
        .collect();
    be.upload_f32(&[rows, cols], &v)
}

/// Every collective once or more, with shapes that vary by rank where the operation allows.
fn run_cases<B: Backend>(be: &B, c: &dyn Collective<B>) -> kimi_ops::Result<Vec<Out>> {
    let (r, w) = (c.rank(), c.world());
    let mut out = Vec::new();
    let mut keep = |name: &str, t: &B::Tensor| -> kimi_ops::Result<()> {
        out.push((name.to_string(), be.shape(t).to_vec(), be.to_f32(t)?));
        Ok(())
    };
    let mut t = input(be, r, 0, 3, 5)?;
    c.all_reduce_sum(be, &mut t)?;
    keep("all_reduce_sum [3, 5]", &t)?;
    let mut t = input(be, r, 1, 64, 4096)?;
    c.all_reduce_sum(be, &mut t)?;
    keep("all_reduce_sum [64, 4096]", &t)?;
    let t = c.all_gather_cols(be, &input(be, r, 2, 4, 3)?)?;
    keep("all_gather_cols [4, 3]", &t)?;
    let t = c.all_gather_cols(be, &input(be, r, 3, 4, 2 + r)?)?;
    keep("all_gather_cols [4, 2 + rank]", &t)?;
    let t = c.all_gather_rows(be, &input(be, r, 4, 2, 6)?)?;
    keep("all_gather_rows [2, 6]", &t)?;
    let t = c.all_gather_rows(be, &input(be, r, 5, r % 3, 6)?)?;
    keep("all_gather_rows [rank % 3, 6]", &t)?;
    let t = c.reduce_scatter_rows(be, &input(be, r, 6, 2 * w, 5)?)?;
    keep("reduce_scatter_rows [2 world, 5]", &t)?;
    let parts = (0..w)
        .map(|j| input(be, r, 7 + j, (r + j) % 3, 4))
        .collect::<kimi_ops::Result<Vec<_>>>()?;
    for (i, t) in c.all_to_all_rows(be, &parts)?.iter().enumerate() {
        keep(&format!("all_to_all_rows from rank {i}"), t)?;
    }
    let mut t = input(be, r, 9, 3, 4)?;
    c.broadcast(be, &mut t, w - 1)?;
    keep("broadcast root world-1", &t)?;
    Ok(out)
}

/// The cases on `world` CPU ranks (threads of one `ThreadGroup`), by rank.
fn cpu_reference(world: usize) -> Res<Vec<Vec<Out>>> {
    let group = ThreadGroup::with_timeout(world, Duration::from_secs(60));
    let cpu = Arc::new(CpuBackend::new());
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (group, cpu) = (Arc::clone(&group), Arc::clone(&cpu));
            std::thread::spawn(move || -> kimi_ops::Result<Vec<Out>> {
                let be = cpu.rank_backend(r)?;
                run_cases(&be, &group.comm(r))
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.push(h.join().map_err(|_| "a CPU rank panicked")??);
    }
    Ok(all)
}

/// The cases on `world` GPUs, one thread per GPU, each rank's communicator from one id.
fn gpu_run(world: usize, timeout: Duration) -> Res<Vec<Vec<Out>>> {
    let id = NcclId::new()?;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || -> kimi_ops::Result<(Vec<Out>, f64)> {
                let be = CudaBackend::new(r)?;
                let comm = NcclComm::new(&be, &id, r, world, timeout)?;
                let outs = run_cases(&be, &comm)?;
                // One more large all-reduce, timed (each call waits for its stream).
                let mut t = input(&be, r, 1, 64, 4096)?;
                let start = Instant::now();
                const REPS: u32 = 20;
                for _ in 0..REPS {
                    comm.all_reduce_sum(&be, &mut t)?;
                }
                Ok((outs, start.elapsed().as_secs_f64() * 1e6 / f64::from(REPS)))
            })
        })
        .collect();
    let mut all = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        let (outs, us) = h.join().map_err(|_| format!("GPU rank {r} panicked"))??;
        if r == 0 {
            println!("  all_reduce_sum [64, 4096] f32 at world {world}: {us:.1} us per call (with the host wait)");
        }
        all.push(outs);
    }
    Ok(all)
}

/// Compares the GPU ranks' outputs with the CPU ranks'; returns the number of mismatches.
fn compare(world: usize, gpu: &[Vec<Out>], cpu: &[Vec<Out>]) -> usize {
    let mut bad = 0;
    for (r, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        for ((name, gs, gv), (_, cs, cv)) in g.iter().zip(c) {
            let same = gs == cs
                && gv.len() == cv.len()
                && gv.iter().zip(cv).all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                bad += 1;
                let diff = gv
                    .iter()
                    .zip(cv)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                println!("  world {world} rank {r} {name}: MISMATCH shape {gs:?} vs {cs:?}, {diff} values differ");
            }
        }
        if g.len() != c.len() {
            bad += 1;
            println!(
                "  world {world} rank {r}: {} outputs vs {}",
                g.len(),
                c.len()
            );
        }
    }
    if bad == 0 {
        println!(
            "  world {world}: {} outputs per rank equal the ThreadGroup's bit for bit",
            cpu[0].len()
        );
    }
    bad
}

/// A call after `abort` must fail at once, naming the reason.
fn check_abort() -> Res<usize> {
    let be = CudaBackend::new(0)?;
    let comm = NcclComm::new(&be, &NcclId::new()?, 0, 1, Duration::from_secs(30))?;
    comm.abort("check: aborted on purpose");
    let mut t = input(&be, 0, 0, 2, 2)?;
    let start = Instant::now();
    match comm.all_reduce_sum(&be, &mut t) {
        Err(e)
            if e.to_string().contains("aborted on purpose")
                && start.elapsed() < Duration::from_secs(1) =>
        {
            println!("  abort: the next call fails at once: {e}");
            Ok(0)
        }
        Err(e) => {
            println!("  abort: FAILED: unexpected error {e}");
            Ok(1)
        }
        Ok(()) => {
            println!("  abort: FAILED: a call after abort succeeded");
            Ok(1)
        }
    }
}

/// Rank `world - 1` skips the second all-reduce: the others must fail within the timeout
/// (plus a margin), naming the operation, and not hang.
fn check_missing_rank(world: usize) -> Res<usize> {
    let timeout = Duration::from_secs(3);
    let id = NcclId::new()?;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || -> kimi_ops::Result<Option<String>> {
                let be = CudaBackend::new(r)?;
                let comm = NcclComm::new(&be, &id, r, world, timeout)?;
                let mut t = input(&be, r, 0, 4, 4)?;
                comm.all_reduce_sum(&be, &mut t)?;
                if r == world - 1 {
                    // Leaves without the second call (as a dead rank would), then waits so
                    // its communicator outlives the others' deadline.
                    std::thread::sleep(timeout + Duration::from_secs(2));
                    comm.abort("rank left");
                    return Ok(None);
                }
                let start = Instant::now();
                let e = comm
                    .all_reduce_sum(&be, &mut t)
                    .err()
                    .map(|e| e.to_string());
                Ok(Some(format!(
                    "{:?} after {:.1} s",
                    e,
                    start.elapsed().as_secs_f64()
                )))
            })
        })
        .collect();
    let mut bad = 0;
    for (r, h) in handles.into_iter().enumerate() {
        match h.join().map_err(|_| format!("GPU rank {r} panicked"))? {
            Ok(None) => {}
            Ok(Some(msg)) if msg.contains("all_reduce_sum") && msg.contains("timed out") => {
                println!("  missing rank: rank {r} ended: {msg}");
            }
            Ok(Some(msg)) => {
                bad += 1;
                println!("  missing rank: FAILED on rank {r}: {msg}");
            }
            Err(e) => {
                bad += 1;
                println!("  missing rank: FAILED on rank {r}: {e}");
            }
        }
    }
    Ok(bad)
}

/// The `nccl` stage.
pub fn check_nccl() -> Res<()> {
    println!("== nccl: NcclComm (GPUs) vs ThreadGroup (CPU ranks), bit for bit");
    println!("  NCCL {}", nccl_version()?);
    // World 1 first: it opens GPU 0, so the driver is initialised before the count.
    let gpu = gpu_run(1, Duration::from_secs(60))?;
    let mut bad = compare(1, &gpu, &cpu_reference(1)?);
    let gpus = cudarc::driver::CudaContext::device_count()? as usize;
    println!("  {gpus} GPU(s) visible");
    if gpus > 1 {
        let gpu = gpu_run(gpus, Duration::from_secs(60))?;
        bad += compare(gpus, &gpu, &cpu_reference(gpus)?);
    }
    bad += check_abort()?;
    if gpus > 1 {
        bad += check_missing_rank(gpus)?;
    } else {
        println!("  missing rank: needs two GPUs (not run)");
    }
    if bad > 0 {
        return Err(format!("nccl: {bad} failure(s)").into());
    }
    println!("nccl: OK");
    Ok(())
}
