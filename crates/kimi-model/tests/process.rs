//! Ranks as processes (`ProcessRanks` + `serve_worker`), each "process" a thread here that
//! reaches rank 0 only through the bootstrap's TCP rendezvous and control link, the tensors
//! meeting in a `ThreadGroup` (NCCL's place on GPUs): the same logits as the ranks as
//! threads (`TensorParallel`) bit for bit, and a worker that dies ends the step at once with
//! its rank named, and every later step too. Plus the control messages' byte form.

use crate::common;

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kimi_core::ModelConfig;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::parallel::control::{decode_reply, encode_reply, RankJob};
use kimi_model::parallel::{serve_worker, ExpertSplit, ProcessRanks, Shard, TensorParallel};
use kimi_model::{
    Batch, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, LoadOptions, ModelError,
    RowPicks, SeqCache, WeightsReopener,
};
use kimi_ops::bootstrap::rendezvous::{join, lead_on, MESSAGE};
use kimi_ops::{KdaMode, MlaMode, RowSampling, Segment, ThreadGroup, TokenPenalty};
use kimi_weights::Checkpoint;

const FIXTURE: &str = "kimi-linear/native-f32-short";
const T: Duration = Duration::from_secs(30);

fn parts(world: usize) -> (ModelConfig, Vec<KimiLinear<CpuBackend>>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(FIXTURE);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let config = ckpt.config().clone();
    let source = CheckpointSource::new(&ckpt).unwrap();
    // Rank 0 can read its weights again; the others' disk is gone (a placement change
    // fails on them).
    let reopen = |rank: usize| {
        let dir = dir.clone();
        WeightsReopener::new(move |f| match rank {
            0 => f(&CheckpointSource::new(
                &Checkpoint::open(&dir).map_err(|e| ModelError::Input(e.to_string()))?,
            )?),
            _ => Err(ModelError::Input("the disk went away".into())),
        })
    };
    let parts = (0..world)
        .map(|rank| {
            let options = LoadOptions {
                shard: Shard {
                    rank,
                    world,
                    experts: ExpertSplit::Experts,
                },
                reopen: Some(reopen(rank)),
                ..LoadOptions::default()
            };
            let be = CpuBackend::with_quant_matmul(QuantMatmul::F32);
            KimiLinear::load_with(be, config.clone(), &source, &options).unwrap()
        })
        .collect();
    (config, parts)
}

/// Rank 0 over `world` "processes"; `worker(rank, part, comm, link)` runs each other rank.
fn process_ranks<F>(world: usize, worker: F) -> (ProcessRanks<CpuBackend>, Vec<JoinHandle<()>>)
where
    F: Fn(
            usize,
            KimiLinear<CpuBackend>,
            kimi_ops::ThreadComm,
            kimi_ops::bootstrap::rendezvous::Link,
        ) + Send
        + Sync
        + Copy
        + 'static,
{
    let (_, parts) = parts(world);
    let group = ThreadGroup::with_timeout(world, T);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut parts = parts.into_iter();
    let lead = parts.next().unwrap();
    let workers = parts
        .enumerate()
        .map(|(i, mut part)| {
            let rank = i + 1;
            let comm = group.comm(rank);
            std::thread::spawn(move || {
                let (link, id) = join("127.0.0.1", port, rank, world, T).unwrap();
                assert_eq!(id, b"nccl-id");
                part.set_collective(Arc::new(comm.clone())).unwrap();
                worker(rank, part, comm, link);
            })
        })
        .collect();
    let links = lead_on(listener, world, b"nccl-id", T)
        .unwrap()
        .into_links();
    let ranks = ProcessRanks::new(lead, Arc::new(group.comm(0)), links, T).unwrap();
    (ranks, workers)
}

fn serve(
    _: usize,
    mut part: KimiLinear<CpuBackend>,
    comm: kimi_ops::ThreadComm,
    link: kimi_ops::bootstrap::rendezvous::Link,
) {
    serve_worker(&mut part, &comm, link).unwrap();
}

/// Logits of every position of `ids`, `step` tokens per pass, then two sequences batched.
fn logits(model: &dyn CausalLm<CpuBackend>, ids: &[u32], step: usize) -> Vec<f32> {
    let mut out = common::logits_in_steps(model, ids, step);
    let mut pool = model.new_pool(16, 4, 4).unwrap();
    let mut a = SeqCache::new(1, vec![0, 1, 2]);
    let mut b = SeqCache::new(3, vec![8, 9]);
    let batch = Batch {
        tokens: [&ids[..5], &ids[2..7]].concat(),
        segments: vec![Segment { start: 0, len: 5 }, Segment { start: 5, len: 5 }],
        logits_rows: vec![4, 9],
        sampling: None,
    };
    let y = model
        .forward(
            &batch,
            &mut pool,
            &mut [&mut a, &mut b],
            ForwardOptions::default(),
        )
        .unwrap();
    model.fork_state(&mut pool, (1, 2), Some((0, 5))).unwrap();
    out.extend(y.logits);
    out
}

#[test]
fn ranks_as_processes_give_the_threads_logits_bit_for_bit() {
    let ids = [3u32, 17, 5, 42, 8, 1, 99, 23, 7];
    let (_, threads) = parts(2);
    let threads = TensorParallel::new(threads, T).unwrap();
    let (procs, workers) = process_ranks(2, serve);
    for step in [ids.len(), 1] {
        let want = logits(&threads, &ids, step);
        let got = logits(&procs, &ids, step);
        assert_eq!(want.len(), got.len());
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "step {step}"
        );
    }
    drop(procs);
    // The workers end normally once rank 0 says goodbye.
    workers.into_iter().for_each(|w| w.join().unwrap());
}

#[test]
fn a_worker_that_dies_ends_the_step_naming_it_and_every_later_step() {
    // Rank 1 makes its pool, then its "process" dies (its link closes).
    let (procs, workers) = process_ranks(2, |_, mut part, _, mut link| {
        let (kind, body) = link.recv(None, "a job").unwrap();
        assert_eq!(kind, MESSAGE);
        let mut pool = None;
        let r = kimi_model::parallel::control::run_job(
            &mut part,
            &mut pool,
            RankJob::decode(&body).unwrap(),
        );
        link.send(MESSAGE, &encode_reply(&r.map_err(|e| e.to_string())))
            .unwrap();
        link.close();
    });
    let (mut pool, mut cache) = procs.single_cache(8).unwrap();
    let batch = Batch {
        tokens: vec![1, 2, 3],
        segments: vec![Segment { start: 0, len: 3 }],
        logits_rows: vec![2],
        sampling: None,
    };
    let start = Instant::now();
    let e = procs
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .expect_err("rank 1 is gone")
        .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert!(e.contains("rank 1"), "{e}");
    let again = procs
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .expect_err("the group is over")
        .to_string();
    assert!(
        again.contains("earlier failure") && again.contains("rank 1"),
        "{again}"
    );
    workers.into_iter().for_each(|w| w.join().unwrap());
}

/// A placement change that a worker cannot stage (its weights cannot be read again) is
/// refused with the rank named, discarded everywhere, and the group goes on as it was.
#[test]
fn a_placement_a_worker_cannot_stage_is_refused_and_the_group_goes_on() {
    use kimi_model::parallel::ExpertPlacement;
    let ids = [3u32, 17, 5, 42, 8, 1, 99, 23, 7];
    let (config, _) = parts(1);
    let e = config.moe.as_ref().unwrap().num_experts;
    // Every MoE layer's experts alternate between the ranks (in order they do not).
    let owners = config
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.ffn == kimi_core::config::Ffn::Moe)
        .map(|(i, _)| (i, (0..e).map(|x| x % 2).collect()))
        .collect();
    let target = Arc::new(ExpertPlacement::from_owners(2, owners).unwrap());
    let (mut procs, workers) = process_ranks(2, serve);
    let before = logits(&procs, &ids, ids.len());
    let err = procs.set_expert_ranks(target).unwrap_err().to_string();
    assert!(
        err.contains("rank 1") && err.contains("the disk went away"),
        "{err}"
    );
    assert!(procs.failure().is_none(), "the group goes on");
    let in_order = ExpertPlacement::default().with_world(2);
    assert_eq!(procs.expert_ranks().as_deref(), Some(&in_order));
    let after = logits(&procs, &ids, ids.len());
    assert!(before
        .iter()
        .zip(&after)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    drop(procs);
    workers.into_iter().for_each(|w| w.join().unwrap());
}

#[test]
fn rank_jobs_round_trip_through_bytes() {
    let jobs = [
        RankJob::Pool {
            num_blocks: 7,
            block_size: 16,
            num_slots: 3,
        },
        RankJob::Single {
            max_tokens: 1 << 20,
        },
        RankJob::Fork {
            slots: (1, 2),
            block: None,
        },
        RankJob::Fork {
            slots: (4, 0),
            block: Some((9, 11)),
        },
        RankJob::Forward {
            batch: Batch {
                tokens: vec![5, 6, 7, 8],
                segments: vec![Segment { start: 0, len: 3 }, Segment { start: 3, len: 1 }],
                logits_rows: vec![2, 3],
                sampling: Some(RowPicks {
                    rows: vec![
                        RowSampling {
                            temperature: 0.7,
                            top_k: 40,
                            top_p: 0.9,
                            min_p: 0.05,
                            repetition_penalty: 1.1,
                            frequency_penalty: 0.2,
                            presence_penalty: -0.3,
                            uniform: 0.123
                        };
                        2
                    ],
                    penalties: vec![TokenPenalty {
                        row: 1,
                        token: 99,
                        count: 3,
                    }],
                }),
            },
            seqs: vec![
                SeqCache {
                    block_table: vec![3, 4],
                    slot: 1,
                    num_tokens: 17,
                },
                SeqCache::new(2, vec![]),
            ],
            opts: ForwardOptions {
                kda_mode: KdaMode::Chunked,
                mla_mode: MlaMode::Absorbed,
                greedy_ids: true,
            },
        },
    ];
    for job in &jobs {
        let bytes = job.encode();
        let back = RankJob::decode(&bytes).unwrap();
        assert_eq!(back.encode(), bytes);
        assert_eq!(format!("{back:?}"), format!("{job:?}"));
        // Cut anywhere, or with a byte too many: an error, never a panic or a wrong job.
        for cut in 0..bytes.len() {
            assert!(RankJob::decode(&bytes[..cut]).is_err());
        }
        assert!(RankJob::decode(&[bytes.as_slice(), &[0]].concat()).is_err());
    }
    for reply in [Ok(()), Err("rank 1: out of memory".to_string())] {
        assert_eq!(decode_reply(&encode_reply(&reply)).unwrap(), reply);
    }
}
