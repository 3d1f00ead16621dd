//! `split`: every fixture split over two ranks on GPU 0, against the same model on one
//! rank. The ranks are threads, each with its own `CudaBackend` on the same GPU, meeting in
//! a `ThreadGroup` (host copies in NCCL's place): what a several-GPU machine would run,
//! minus NCCL, which `nccl` checks on its own. Tensor parallel (heads, widths and experts'
//! widths split) and expert parallel (whole experts per rank). A split sums its partial
//! outputs in another order than one rank's matmuls do, so the logits agree to rounding:
//! f32 products give 1e-5 on the CPU; here the device's bf16 products, the bf16
//! tolerance (1e-2), and the error is printed. Fixtures whose heads do not split over two
//! ranks, and expert parallelism where the backend refuses it, are reported as such.

use std::time::Duration;

use kimi_cuda::CudaBackend;
use kimi_model::parallel::{ExpertSplit, Shard, TensorParallel};
use kimi_model::{CausalLm, ForwardOptions, KimiLinear, LoadOptions};

use super::{fixture_dirs, fixture_prompt, rel_err, run_model, Res};

/// The fixture's model over `world` ranks on GPU 0, split as `experts` says.
fn split_model(
    ckpt: &kimi_weights::Checkpoint,
    world: usize,
    experts: ExpertSplit,
) -> Res<TensorParallel<CudaBackend>> {
    let source = kimi_model::CheckpointSource::new(ckpt)?;
    let mut parts = Vec::with_capacity(world);
    for rank in 0..world {
        let options = LoadOptions {
            shard: Shard {
                rank,
                world,
                experts,
            },
            ..LoadOptions::default()
        };
        let be = CudaBackend::new(0)?;
        parts.push(KimiLinear::load_with(
            be,
            ckpt.config().clone(),
            &source,
            &options,
        )?);
    }
    Ok(TensorParallel::new(parts, Duration::from_secs(120))?)
}

pub fn check_split() -> Res<()> {
    println!("== split: fixtures over two ranks on GPU 0 (ThreadGroup) against one rank");
    let dirs = fixture_dirs()?;
    let (mut failures, mut compared) = (0, 0);
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ckpt = kimi_weights::Checkpoint::open(&dir)?;
        let one = KimiLinear::load(CudaBackend::new(0)?, &ckpt)?;
        let prompt = fixture_prompt(&dir)?;
        for (label, experts) in [
            ("tensor", ExpertSplit::Tensor),
            ("expert", ExpertSplit::Experts),
        ] {
            let split = match split_model(&ckpt, 2, experts) {
                Ok(m) => m,
                Err(e) => {
                    println!("{name:<28} {label} parallel: does not split ({e})");
                    continue;
                }
            };
            for step in [1, 16] {
                let want = run_model(&one, &prompt, step, ForwardOptions::default())?;
                let got = run_model(
                    &split as &dyn CausalLm<_>,
                    &prompt,
                    step,
                    ForwardOptions::default(),
                );
                let got = match got {
                    Ok(g) => g,
                    Err(e) if e.to_string().contains("not supported") => {
                        println!("{name:<28} {label} parallel step {step:<2}: refused ({e})");
                        break;
                    }
                    Err(e) => {
                        failures += 1;
                        println!("{name:<28} {label} parallel step {step:<2}: FAIL ({e})");
                        break;
                    }
                };
                let err = rel_err(&got, &want);
                let finite = got.iter().all(|v| v.is_finite());
                let ok = finite && err < 1e-2;
                compared += 1;
                if !ok {
                    failures += 1;
                }
                println!(
                    "{name:<28} {label} parallel step {step:<2}: rel err {err:.2e} against one \
                     rank ({})",
                    if ok { "ok" } else { "FAIL" }
                );
            }
        }
    }
    println!("split: {compared} comparisons, {failures} failed");
    if failures > 0 || compared == 0 {
        return Err(format!("{failures} split cases failed, {compared} compared").into());
    }
    Ok(())
}
