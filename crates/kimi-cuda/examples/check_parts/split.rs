//! `split`: every fixture split over two ranks on GPU 0, against the same model on one
//! rank. The ranks are threads, each with its own `CudaBackend` on the same GPU, meeting in
//! a `ThreadGroup` (host copies in NCCL's place): what a several-GPU machine would run,
//! minus NCCL, which `nccl` checks on its own. Tensor parallel (heads, widths and experts'
//! widths split) and expert parallel (whole experts per rank). A split sums its partial
//! outputs in another order than one rank's matmuls do, so the logits agree to rounding:
//! f32 products give 1e-5 on the CPU; here the device's bf16 products, the bf16
//! tolerance (1e-2), and the error is printed. Fixtures whose heads do not split over two
//! ranks, and expert parallelism where the backend refuses it, are reported as such.

use std::path::PathBuf;
use std::time::Duration;

use kimi_cuda::CudaBackend;
use kimi_model::parallel::{ExpertSplit, Shard, TensorParallel};
use kimi_model::{CausalLm, ForwardOptions, KimiLinear, LoadOptions};

use super::{run_model, Res};

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den).sqrt()
}

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
    let mut dirs: Vec<PathBuf> = ["fixtures/kimi-linear", "fixtures/kimi-k3"]
        .iter()
        .filter_map(|root| std::fs::read_dir(root).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    let (mut failures, mut compared) = (0, 0);
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ckpt = kimi_weights::Checkpoint::open(&dir)?;
        let one = KimiLinear::load(CudaBackend::new(0)?, &ckpt)?;
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let prompt: Vec<u32> = reference["prompt_ids"]
            .as_array()
            .ok_or("prompt_ids")?
            .iter()
            .filter_map(|x| x.as_u64().map(|v| v as u32))
            .collect();
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
