//! `offload`: experts beyond GPU memory on the device. Each fixture runs with its routed
//! experts all resident, then split into tiers (some in host RAM behind device cache slots,
//! cold ones computed on the CPU), with the host store page-locked and slots filled by
//! asynchronous copies (`pin_host_experts`, the default) and without. Where no expert is
//! cold and both models run the same kernels (Kimi K3's composed MoE) the logits must be the
//! resident bits; a resident Kimi Linear layer takes the fused MoE step instead, whose sums
//! run in another order than the composed one's (on the device; the CPU's agree bit for bit),
//! so there they must be within f32 rounding (1e-5) of the resident logits. Where experts are
//! cold the CPU computes them with f32 products while the device's MXFP4 experts take
//! split-precision bf16 ones (each 1e-5 from the CPU's at the op level; K3's fixtures 1e-4
//! from the float64 reference on the device): the bf16 tolerance, 1e-3.

use std::io::Write;
use std::sync::Arc;

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_cuda::CudaBackend;
use kimi_model::{ExpertOffload, ForwardOptions, KimiLinear, LoadOptions, OffloadAmount};
use kimi_ops::offload::{CachePolicy, HostBackend};

use super::k3_cases::mxfp4_blocks;
use super::op_cases::Rng;
use super::quant_cases::quant_blocks;
use super::{rel_err, run_model, Res};

/// Fills a slot holding `old` (stored blocks of `dtype`, `[rows, cols]`) with `new` on `be`
/// and prints whether it widens to the CPU's values of `new` bit for bit; `true` if so.
fn fill_gives_cpu_values(
    be: &CudaBackend,
    dtype: kimi_core::DType,
    (rows, cols): (usize, usize),
    old: &[u8],
    new: &[u8],
    on_device: bool,
) -> Res<bool> {
    use kimi_ops::{Backend, HostTensor};
    let shape = [rows, cols];
    let tensor = |bytes| HostTensor {
        shape: &shape,
        dtype,
        bytes,
    };
    let mut slot = be.upload(tensor(old))?;
    be.upload_into(&mut slot, tensor(new))?;
    let got = be.to_f32(&slot)?;
    let cpu = CpuBackend::with_quant_matmul(QuantMatmul::F32);
    let want = cpu.to_f32(&cpu.upload(tensor(new))?)?;
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits());
    println!(
        "{dtype} slot fill {rows} x {cols}, laid out on the {}: {}",
        if on_device { "GPU" } else { "host" },
        if same {
            "the CPU's values (ok)"
        } else {
            "FAIL: not the CPU's values"
        }
    );
    Ok(same)
}

/// A slot fill of MXFP4 blocks laid out by the device (`upload_into`: the stored blocks
/// copied, then `mxfp4_from_blocks`) must widen to the CPU's values of the new blocks bit
/// for bit, the tiles' padding included (37 x 96 pads rows and columns). Returns failures.
fn check_mxfp4_fills() -> Res<usize> {
    let mut rng = Rng(7);
    let mut failures = 0;
    for ((rows, cols), on_device) in [(37usize, 96usize), (64, 256), (3072, 3584)]
        .into_iter()
        .flat_map(|s| [(s, false), (s, true)])
    {
        let be = CudaBackend::new(0)?;
        be.update_kernel_config(|c| c.mxfp4_device_fills = on_device)?;
        let (old, new) = (
            mxfp4_blocks(&mut rng, rows, cols, false),
            mxfp4_blocks(&mut rng, rows, cols, false),
        );
        let dtype = kimi_core::DType::MXFP4;
        if !fill_gives_cpu_values(&be, dtype, (rows, cols), &old, &new, on_device)? {
            failures += 1;
        }
    }
    Ok(failures)
}

/// A slot fill of a packed type (Q4Z, Q8Z, F8S, ggml Q4_0, Q8_0, Q4_1, Q4_K), laid out in
/// the device planes on the host or on the GPU (`quant_from_blocks`), must widen to the
/// CPU's values of the new blocks bit for bit. Returns failures.
fn check_packed_fills() -> Res<usize> {
    use kimi_core::DType;
    let mut rng = Rng(11);
    let mut failures = 0;
    let dtypes = [
        DType::Q4Z,
        DType::Q8Z,
        DType::F8S,
        DType::Q4_0,
        DType::Q8_0,
        DType::Q4_1,
        DType::Q4_K,
    ];
    for dtype in dtypes {
        for ((rows, cols), on_device) in [(37usize, 256usize), (1024, 2304)]
            .into_iter()
            .flat_map(|s| [(s, false), (s, true)])
        {
            let be = CudaBackend::new(0)?;
            be.update_kernel_config(|c| c.packed_device_fills = on_device)?;
            let (old, new) = (
                quant_blocks(&mut rng, dtype, rows, cols),
                quant_blocks(&mut rng, dtype, rows, cols),
            );
            if !fill_gives_cpu_values(&be, dtype, (rows, cols), &old, &new, on_device)? {
                failures += 1;
            }
        }
    }
    Ok(failures)
}

pub fn check_offload() -> Res<()> {
    println!(
        "== offload: fixtures with experts in tiers (host RAM + device slots + cold on the CPU) \
         against all resident, page-locked fills and staged ones"
    );
    let dirs = super::fixture_dirs()?;
    let mut failures = check_mxfp4_fills()? + check_packed_fills()?;
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ckpt = kimi_weights::Checkpoint::open(&dir)?;
        let resident = KimiLinear::load(CudaBackend::new(0)?, &ckpt)?;
        let Some(moe) = resident.config().moe.as_ref() else {
            continue;
        };
        let experts = moe.num_experts;
        // As `FfnLayer::load_moe` decides: resident SwiGLU experts without a latent take the
        // backend's fused MoE step; experts in tiers always take the composed one.
        let fused_when_resident = resident.config().activation
            == kimi_core::config::Activation::Silu
            && moe.latent.is_none();
        let prompt = super::fixture_prompt(&dir)?;
        for step in [1, 16] {
            let want = run_model(&resident, &prompt, step, ForwardOptions::default())?;
            // All but one host expert in slots: misses copied in, rarely cold, so copies
            // ahead (on the copy stream) must leave the resident bits.
            let splits = [
                (experts, experts),
                (experts / 2, 2),
                (experts, 1),
                (experts, experts - 1),
            ];
            for (host, slots) in splits {
                // Page-locked, staged, and page-locked with copies ahead on the next
                // layer's prediction (on the copy stream).
                for (pinned, ahead) in [(true, false), (false, false), (true, true)] {
                    let be = CudaBackend::new(0)?;
                    // Page-locked fills lay MXFP4 experts out on the GPU, staged ones anew
                    // on the host.
                    be.update_kernel_config(|c| {
                        c.pin_host_experts = pinned;
                        c.mxfp4_device_fills = pinned;
                    })?;
                    let options = tiered(host, slots, ahead);
                    let model = KimiLinear::load_checkpoint_with(be, &ckpt, &options)?;
                    let got = run_model(&model, &prompt, step, ForwardOptions::default())?;
                    let c = model.offload_counts().ok_or("no offload counts")?;
                    let err = rel_err(&got, &want);
                    let verdict = if got == want {
                        "resident bits"
                    } else if c.cold_pairs == 0 && !fused_when_resident {
                        failures += 1;
                        "FAIL: not the resident bits"
                    } else if err < if c.cold_pairs == 0 { 1e-5 } else { 1e-3 } {
                        "ok"
                    } else {
                        failures += 1;
                        "FAIL"
                    };
                    println!(
                        "{name:<28} step {step:<2} host {host:>2} slots {slots:>2} {}: rel err \
                         {err:.2e} ({verdict}); fills {} (ahead {}, used {}) hits {} cold pairs \
                         {} moved {} B",
                        match (pinned, ahead) {
                            (true, true) => "locked, ahead",
                            (true, false) => "locked",
                            _ => "staged",
                        },
                        c.fills,
                        c.ahead_fills,
                        c.ahead_used,
                        c.hits,
                        c.cold_pairs,
                        c.bytes_moved
                    );
                    let _ = std::io::stdout().flush();
                    if pinned && !ahead && step == 1 {
                        failures += check_segment_graphs(&ckpt, host, slots, &prompt, &got)?;
                    }
                }
            }
        }
    }
    if failures > 0 {
        return Err(format!("{failures} offload cases failed").into());
    }
    Ok(())
}

/// The tiered model decoding through CUDA graphs (one per segment between route
/// read-backs) gives the bits it gives op by op.
fn check_segment_graphs(
    ckpt: &kimi_weights::Checkpoint,
    host: usize,
    slots: usize,
    prompt: &[u32],
    want: &[f32],
) -> Res<usize> {
    let be = CudaBackend::new(0)?;
    be.update_kernel_config(|c| {
        c.pin_host_experts = true;
        c.mxfp4_device_fills = true;
        c.cuda_graphs = true;
    })?;
    let model = KimiLinear::load_checkpoint_with(be, ckpt, &tiered(host, slots, false))?;
    let got = run_model(&model, prompt, 1, ForwardOptions::default())?;
    let [eager, captured, replayed] = model.backend().graph_pass_counts();
    let same = got == want;
    println!(
        "  graphs per segment: {} (eager {eager}, captured {captured}, replayed {replayed})",
        if same {
            "op-by-op bits"
        } else {
            "FAIL: not the op-by-op bits"
        }
    );
    // Replays are a matter of speed (a segment whose ops changed is captured again), not of
    // the result: counted, not required.
    Ok(usize::from(!same))
}

/// Load options putting `host` experts per layer in host RAM (computed there on the CPU's
/// f32 kernels when cold) behind `slots` device slots, copied `ahead` (on the next layer's
/// prediction, and the cold ones after the host computed them) or not.
fn tiered(host: usize, slots: usize, ahead: bool) -> LoadOptions {
    let store = HostBackend::new(Arc::new(CpuBackend::with_quant_matmul(QuantMatmul::F32)));
    LoadOptions {
        offload: Some(ExpertOffload {
            host: OffloadAmount::Experts(host),
            cache: OffloadAmount::Experts(slots),
            policy: CachePolicy {
                predict_next: ahead,
                copy_behind: ahead,
                ..CachePolicy::default()
            },
            store: Arc::new(store),
        }),
        ..LoadOptions::default()
    }
}
