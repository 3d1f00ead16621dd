//! Beam search in the serving engine on the tiny Kimi Linear checkpoint: against a
//! brute-force beam search written here that runs the model one whole sequence at a time,
//! one beam against greedy, batched against alone, under cache pressure, and refusals.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use kimi_cpu::CpuBackend;
use kimi_engine::beam::{BeamOutput, BeamParams};
use kimi_engine::sampling::SamplingParams;
use kimi_engine::{
    Engine, EngineHandle, Event, FinishReason, LogitsProcessor, Request, ServingConfig, SubmitError,
};
use kimi_model::KimiLinear;
use kimi_weights::Checkpoint;
use tokio::sync::mpsc::UnboundedReceiver;

const FIXTURE: &str = "../../fixtures/kimi-linear/hub-bf16-released-like";
const DEADLINE: Duration = Duration::from_secs(60);
/// The engine's batched decode and the reference's whole-sequence prefill run different
/// kernels (recurrent against chunked KDA, absorbed against expanded MLA).
const SCORE_TOLERANCE: f64 = 1e-5;

/// Whether the cache's usage reaches zero within ten seconds: the engine publishes its
/// metrics at the end of the step that sent a request's last event, so a client that has
/// just read that event may still see the step before (under emulation, for a while).
fn blocks_come_back(usage: impl Fn() -> f64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if usage() == 0.0 {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn model() -> KimiLinear<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
    let ckpt = Checkpoint::open(&dir).expect("fixture checkpoint opens");
    KimiLinear::load(CpuBackend::new(), &ckpt).expect("fixture loads")
}

fn eos_ids() -> Vec<u32> {
    model().config().eos_token_ids.clone()
}

fn config() -> ServingConfig {
    ServingConfig {
        max_model_len: 256,
        max_num_seqs: 32,
        max_num_batched_tokens: 4096,
        block_size: 4,
        num_blocks: 1024,
        max_waiting: 64,
        expert_rebalance: None,
    }
}

/// Deterministic prompt of `len` ids in `3..256`, different for each `seed`.
fn prompt(seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| 3 + ((seed * 7919 + i * 104_729 + i * i * 31) % 253) as u32)
        .collect()
}

fn beams(num_beams: usize, num_return: usize, length_penalty: f32, early: bool) -> BeamParams {
    BeamParams {
        num_beams,
        num_return,
        length_penalty,
        early_stopping: early,
    }
}

fn params(beam: BeamParams, max_tokens: usize, stop_token_ids: Vec<u32>) -> SamplingParams {
    SamplingParams {
        max_tokens,
        stop_token_ids,
        beam: Some(beam),
        ..SamplingParams::default()
    }
}

fn request(prompt: Vec<u32>, params: SamplingParams) -> Request {
    Request {
        prompt,
        params,
        eos_ids: eos_ids(),
        logits_processor: None,
    }
}

/// The beams a request reported, and how it finished.
fn collect(rx: &mut UnboundedReceiver<Event>) -> (Vec<BeamOutput>, FinishReason, usize) {
    let start = Instant::now();
    let mut beams = None;
    let mut started = false;
    loop {
        let event = match rx.try_recv() {
            Ok(event) => event,
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(start.elapsed() < DEADLINE, "no event within {DEADLINE:?}");
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            Err(e) => panic!("the engine dropped the request: {e}"),
        };
        match event {
            Event::Started { .. } => started = true,
            Event::Token(t) => panic!("beam search streamed a token: {t:?}"),
            Event::Beams(b) => beams = Some(b),
            Event::Finished {
                reason,
                completion_tokens,
                ..
            } => {
                assert!(started, "Started comes first");
                let beams = beams.expect("Beams comes before Finished");
                return (beams, reason, completion_tokens);
            }
            Event::Error(e) => panic!("the request failed: {e}"),
        }
    }
}

/// A finished hypothesis of the reference: output tokens and score.
#[derive(Clone, Debug)]
struct Hypothesis {
    tokens: Vec<u32>,
    cumulative: f64,
    score: f64,
    stopped: bool,
}

/// Log-softmax in f64 of the model's logits after `ids`, from a fresh cache (one prefill
/// of the whole sequence).
fn logprobs_after(engine: &Engine<CpuBackend>, ids: &[u32]) -> Vec<f64> {
    let vocab = engine.model().vocab_size();
    let all = engine.logits(ids, ids.len()).expect("logits");
    let row = &all[(ids.len() - 1) * vocab..];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - total.ln()).collect()
}

/// Hugging Face's beam search (`BeamSearchScorer`, `BeamHypotheses`), spelled out over
/// every (beam, token) pair, each beam's row from its own forward pass.
fn reference(
    engine: &Engine<CpuBackend>,
    prompt: &[u32],
    beam: &BeamParams,
    max_tokens: usize,
    stop_ids: &[u32],
) -> Vec<Hypothesis> {
    let k = beam.num_beams;
    let lp = f64::from(beam.length_penalty);
    let mut running: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 0.0)];
    let mut kept: Vec<Hypothesis> = Vec::new();
    let add = |kept: &mut Vec<Hypothesis>, tokens: Vec<u32>, cum: f64, len: usize, stopped| {
        let score = cum / (len as f64).powf(lp);
        let worst = kept.iter().map(|h| h.score).fold(f64::INFINITY, f64::min);
        if kept.len() < k || score > worst {
            kept.push(Hypothesis {
                tokens,
                cumulative: cum,
                score,
                stopped,
            });
            if kept.len() > k {
                let (i, _) = kept
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.score.total_cmp(&b.1.score))
                    .expect("not empty");
                kept.remove(i);
            }
        }
    };
    for step in 1..=max_tokens {
        let mut all: Vec<(f64, usize, u32)> = Vec::new();
        for (b, (tokens, cum)) in running.iter().enumerate() {
            let ids: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
            for (t, lp) in logprobs_after(engine, &ids).into_iter().enumerate() {
                all.push((cum + lp, b, t as u32));
            }
        }
        all.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        all.truncate((1 + stop_ids.len()).max(2) * k);
        let mut next = Vec::new();
        for (rank, &(score, b, t)) in all.iter().enumerate() {
            if stop_ids.contains(&t) {
                if rank < k {
                    add(&mut kept, running[b].0.clone(), score, step, true);
                }
            } else {
                let mut tokens = running[b].0.clone();
                tokens.push(t);
                next.push((tokens, score));
            }
            if next.len() == k {
                break;
            }
        }
        let done = kept.len() >= k
            && (beam.early_stopping || {
                let worst = kept.iter().map(|h| h.score).fold(f64::INFINITY, f64::min);
                worst >= all[0].0 / (step as f64).powf(lp)
            });
        if done {
            break;
        }
        running = next;
        if step == max_tokens {
            for (tokens, cum) in running.drain(..) {
                add(&mut kept, tokens, cum, step, false);
            }
        }
    }
    kept.sort_by(|a, b| b.score.total_cmp(&a.score));
    kept.truncate(beam.num_return);
    kept
}

fn assert_matches(got: &[BeamOutput], want: &[Hypothesis], case: &str) {
    assert_eq!(got.len(), want.len(), "{case}: number of beams");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tokens: Vec<u32> = g.tokens.iter().map(|t| t.token).collect();
        assert_eq!(tokens, w.tokens, "{case}: beam {i} tokens");
        assert!(
            (g.score - w.score).abs() <= SCORE_TOLERANCE,
            "{case}: beam {i} score {} against {}",
            g.score,
            w.score
        );
        assert!(
            (g.cumulative_logprob - w.cumulative).abs() <= SCORE_TOLERANCE,
            "{case}: beam {i} cumulative logprob {} against {}",
            g.cumulative_logprob,
            w.cumulative
        );
        let want_finish = if w.stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(g.finish, want_finish, "{case}: beam {i} finish");
        let sum: f64 = g.tokens.iter().map(|t| f64::from(t.logprob)).sum();
        assert!(
            w.stopped || (sum - g.cumulative_logprob).abs() <= SCORE_TOLERANCE,
            "{case}: beam {i} token logprobs sum to its cumulative logprob"
        );
    }
}

/// The most likely tokens after `prompt`, for choosing stop tokens the search will meet.
fn likely_tokens(engine: &Engine<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let lps = logprobs_after(engine, prompt);
    let mut ids: Vec<u32> = (0..lps.len() as u32).collect();
    ids.sort_by(|a, b| lps[*b as usize].total_cmp(&lps[*a as usize]));
    ids.truncate(n);
    ids
}

struct Case {
    prompt: Vec<u32>,
    beam: BeamParams,
    max_tokens: usize,
    stop_ids: Vec<u32>,
}

fn cases(single: &Engine<CpuBackend>) -> Vec<Case> {
    let p = |seed, len| prompt(seed, len);
    // Stop tokens the search meets: the second choice after the prompt, and one a few
    // tokens later.
    let early_stop = likely_tokens(single, &p(3, 7), 2)[1];
    let later_stop = likely_tokens(single, &p(4, 5), 4)[3];
    vec![
        Case {
            prompt: p(1, 9),
            beam: beams(4, 4, 1.0, false),
            max_tokens: 6,
            stop_ids: vec![],
        },
        Case {
            prompt: p(2, 1),
            beam: beams(3, 2, 0.0, true),
            max_tokens: 5,
            stop_ids: vec![],
        },
        Case {
            prompt: p(3, 7),
            beam: beams(3, 3, 1.0, false),
            max_tokens: 6,
            stop_ids: vec![early_stop],
        },
        Case {
            prompt: p(4, 5),
            beam: beams(5, 3, -0.5, true),
            max_tokens: 7,
            stop_ids: vec![later_stop, early_stop],
        },
        Case {
            prompt: p(5, 13),
            beam: beams(2, 1, 2.0, false),
            max_tokens: 8,
            stop_ids: vec![later_stop],
        },
    ]
}

#[test]
fn beam_search_equals_a_brute_force_reference() {
    let single = Engine::new(model());
    let eos = eos_ids();
    let engine = EngineHandle::spawn(model(), config()).expect("engine starts");
    let mut num_stopped = 0;
    for (i, case) in cases(&single).into_iter().enumerate() {
        let mut stop_ids = case.stop_ids.clone();
        stop_ids.extend(&eos);
        let want = reference(
            &single,
            &case.prompt,
            &case.beam,
            case.max_tokens,
            &stop_ids,
        );
        let p = params(case.beam.clone(), case.max_tokens, case.stop_ids.clone());
        let (_, mut rx) = engine
            .submit(request(case.prompt.clone(), p))
            .expect("accepted");
        let (got, reason, completion) = collect(&mut rx);
        assert_matches(&got, &want, &format!("case {i} ({:?})", case.beam));
        assert_eq!(reason, got[0].finish, "case {i}: the best beam's reason");
        let tokens: usize = got.iter().map(|b| b.tokens.len()).sum();
        assert_eq!(completion, tokens, "case {i}: completion tokens");
        num_stopped += got
            .iter()
            .filter(|b| b.finish == FinishReason::Stop)
            .count();
    }
    assert!(num_stopped > 0, "some beams end on a stop token");
    assert!(
        blocks_come_back(|| engine.metrics().cache_usage),
        "every beam's blocks came back"
    );
    engine.shutdown(true);
}

#[test]
fn one_beam_is_greedy() {
    let single = Engine::new(model());
    let eos = eos_ids();
    let engine = EngineHandle::spawn(model(), config()).expect("engine starts");
    for seed in 0..6 {
        let prompt = prompt(seed, 1 + seed * 5);
        // A stop token greedy decoding meets after a few tokens, and none.
        let greedy = SamplingParams {
            max_tokens: 12,
            ..SamplingParams::default()
        };
        let g = single
            .generate(&prompt, &greedy, &eos, |_| ControlFlow::Continue(()))
            .expect("generates");
        let stop = if seed % 2 == 0 {
            vec![g.tokens[3].token]
        } else {
            vec![]
        };
        let greedy = SamplingParams {
            stop_token_ids: stop.clone(),
            ..greedy
        };
        let g = single
            .generate(&prompt, &greedy, &eos, |_| ControlFlow::Continue(()))
            .expect("generates");
        let want: Vec<u32> = g.tokens.iter().map(|t| t.token).collect();
        let p = params(beams(1, 1, 1.0, seed % 3 == 0), 12, stop);
        let (_, mut rx) = engine.submit(request(prompt, p)).expect("accepted");
        let (got, reason, _) = collect(&mut rx);
        let tokens: Vec<u32> = got[0].tokens.iter().map(|t| t.token).collect();
        assert_eq!(tokens, want, "seed {seed}");
        assert_eq!(reason, g.finish, "seed {seed}");
    }
    engine.shutdown(true);
}

/// Beams decode in the same steps as other requests and as each other; what they find is
/// what they find alone, to the bit.
#[test]
fn batched_beams_equal_beams_alone() {
    let single = Engine::new(model());
    let all = cases(&single);
    let alone: Vec<Vec<BeamOutput>> = all
        .iter()
        .map(|case| {
            let engine = EngineHandle::spawn(model(), config()).expect("engine starts");
            let p = params(case.beam.clone(), case.max_tokens, case.stop_ids.clone());
            let (_, mut rx) = engine
                .submit(request(case.prompt.clone(), p))
                .expect("accepted");
            let got = collect(&mut rx).0;
            engine.shutdown(true);
            got
        })
        .collect();
    let engine = EngineHandle::spawn(model(), config()).expect("engine starts");
    let greedy = SamplingParams {
        max_tokens: 10,
        logprobs: Some(0),
        ..SamplingParams::default()
    };
    let mut others: Vec<_> = (0..4)
        .map(|i| {
            let (_, rx) = engine
                .submit(request(prompt(20 + i, 3 + 11 * i), greedy.clone()))
                .expect("accepted");
            rx
        })
        .collect();
    let mut rxs: Vec<_> = all
        .iter()
        .map(|case| {
            let p = params(case.beam.clone(), case.max_tokens, case.stop_ids.clone());
            engine
                .submit(request(case.prompt.clone(), p))
                .expect("accepted")
                .1
        })
        .collect();
    for (i, (rx, want)) in rxs.iter_mut().zip(&alone).enumerate() {
        assert_eq!(&collect(rx).0, want, "case {i}");
    }
    for rx in &mut others {
        while let Some(event) = rx.blocking_recv() {
            if let Event::Error(e) = event {
                panic!("a greedy request beside the beams failed: {e}");
            }
        }
    }
    engine.shutdown(true);
}

/// A cache too small for every beam at once: beams are preempted and forks prefilled
/// anew, and the search still finds the reference's beams.
#[test]
fn beams_under_cache_pressure_match_the_reference() {
    let single = Engine::new(model());
    let eos = eos_ids();
    let config = ServingConfig {
        max_model_len: 32,
        max_num_seqs: 6,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_blocks: 12,
        max_waiting: 16,
        expert_rebalance: None,
    };
    let engine = EngineHandle::spawn(model(), config).expect("engine starts");
    let beam = beams(4, 4, 1.0, false);
    let prompt = prompt(7, 6);
    let want = reference(&single, &prompt, &beam, 6, &eos);
    // Two greedy requests compete for the blocks. The first holds the engine in its
    // logits processor until every request is queued, so none finishes before the beams
    // arrive.
    let greedy = SamplingParams {
        max_tokens: 24,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let (open, gate) = std::sync::mpsc::channel::<()>();
    let gated = Request {
        logits_processor: Some(Box::new(Gate(gate))),
        ..request(self::prompt(30, 8), greedy.clone())
    };
    let first = engine.submit(gated).expect("accepted").1;
    let second = engine
        .submit(request(self::prompt(31, 8), greedy))
        .expect("accepted")
        .1;
    let (_, mut rx) = engine
        .submit(request(prompt, params(beam, 6, vec![])))
        .expect("accepted");
    drop(open);
    let (got, _, _) = collect(&mut rx);
    assert_matches(&got, &want, "under pressure");
    assert!(
        engine.metrics().num_preemptions_total > 0,
        "the cache was too small for every sequence"
    );
    drop((first, second));
    engine.shutdown(false);
}

/// Blocks the engine in `mask` until the sender is dropped.
struct Gate(std::sync::mpsc::Receiver<()>);

impl LogitsProcessor for Gate {
    fn mask(&mut self, _logits: &mut [f32]) {
        let _ = self.0.recv();
    }
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        Ok(())
    }
    fn is_finished(&self) -> bool {
        false
    }
}

struct Nothing;

impl LogitsProcessor for Nothing {
    fn mask(&mut self, _logits: &mut [f32]) {}
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        Ok(())
    }
    fn is_finished(&self) -> bool {
        false
    }
}

#[test]
fn impossible_beam_searches_are_refused_with_the_reason() {
    let config = ServingConfig {
        max_model_len: 64,
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_blocks: 40,
        max_waiting: 16,
        expert_rebalance: None,
    };
    let engine = EngineHandle::spawn(model(), config).expect("engine starts");
    let refused = |req: Request| match engine.submit(req) {
        Err(SubmitError::Invalid(message)) => message,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let wide = refused(request(
        prompt(1, 4),
        params(beams(5, 1, 1.0, false), 4, vec![]),
    ));
    assert!(wide.contains("--max-num-seqs"), "{wide}");
    let long = refused(request(
        prompt(1, 4),
        params(beams(4, 1, 1.0, false), 50, vec![]),
    ));
    assert!(long.contains("cache blocks"), "{long}");
    let zero = refused(request(
        prompt(1, 4),
        params(beams(0, 1, 1.0, false), 4, vec![]),
    ));
    assert!(zero.contains("num_beams"), "{zero}");
    let more = refused(request(
        prompt(1, 4),
        params(beams(2, 3, 1.0, false), 4, vec![]),
    ));
    assert!(more.contains("num_return"), "{more}");
    let hot = SamplingParams {
        temperature: 0.8,
        ..params(beams(2, 1, 1.0, false), 4, vec![])
    };
    assert!(refused(request(prompt(1, 4), hot)).contains("temperature"));
    let constrained = Request {
        logits_processor: Some(Box::new(Nothing)),
        ..request(prompt(1, 4), params(beams(2, 1, 1.0, false), 4, vec![]))
    };
    assert!(refused(constrained).contains("constrained decoding"));
    // At the limits it runs: 4 beams of 8 tokens after 4 need 1 + 4 * 2 blocks of 40.
    let (_, mut rx) = engine
        .submit(request(
            prompt(1, 4),
            params(beams(4, 2, 1.0, false), 8, vec![]),
        ))
        .expect("fits");
    assert_eq!(collect(&mut rx).0.len(), 2);
    engine.shutdown(true);
}

/// Beams of a model split over two ranks (threads): forks copy the KDA state and the
/// partial block in every rank's pool, so the beams equal those of the whole model.
#[test]
fn beams_of_a_model_split_over_ranks_equal_the_whole_models() {
    use kimi_model::parallel::{ExpertSplit, Shard, TensorParallel};
    use kimi_model::{CheckpointSource, LoadOptions};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let ckpt = Checkpoint::open(&dir).expect("fixture opens");
    let source = CheckpointSource::new(&ckpt).expect("source");
    let part = |shard: Shard| {
        let options = LoadOptions {
            shard,
            ..LoadOptions::default()
        };
        // f32 products: the int8 path quantizes activations per block, and a split's f32
        // rounding (1e-7) can move a value across a rounding step there (on aarch64 the
        // scores then moved by 1e-3), which is not what this test is about.
        let backend = CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
        KimiLinear::load_with(backend, ckpt.config().clone(), &source, &options)
            .expect("part loads")
    };
    let parts = (0..2)
        .map(|rank| {
            part(Shard {
                rank,
                world: 2,
                experts: ExpertSplit::Tensor,
            })
        })
        .collect();
    let split = TensorParallel::new(parts, Duration::from_secs(60)).expect("ranks start");
    let whole = EngineHandle::spawn(part(Shard::SINGLE), config()).expect("engine starts");
    let split = EngineHandle::spawn(split, config()).expect("engine starts");
    let eos = ckpt.config().eos_token_ids.clone();
    for (seed, beam) in [(1, beams(3, 2, 1.0, false)), (2, beams(4, 4, 0.5, true))] {
        let request = |eos: &[u32]| Request {
            prompt: prompt(seed, 9),
            params: params(beam.clone(), 6, Vec::new()),
            eos_ids: eos.to_vec(),
            logits_processor: None,
        };
        let (_, mut rx) = whole.submit(request(&eos)).expect("accepted");
        let (want, ..) = collect(&mut rx);
        let (_, mut rx) = split.submit(request(&eos)).expect("accepted");
        let (got, ..) = collect(&mut rx);
        assert_eq!(got.len(), want.len(), "seed {seed}");
        for (g, w) in got.iter().zip(&want) {
            let tokens = |b: &BeamOutput| b.tokens.iter().map(|t| t.token).collect::<Vec<_>>();
            assert_eq!(tokens(g), tokens(w), "seed {seed}");
            assert!((g.score - w.score).abs() <= SCORE_TOLERANCE, "seed {seed}");
        }
    }
    assert!(
        blocks_come_back(|| split.metrics().cache_usage),
        "every beam's blocks came back"
    );
    whole.shutdown(true);
    split.shutdown(true);
}
