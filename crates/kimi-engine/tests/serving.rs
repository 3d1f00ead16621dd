//! The serving engine on a real (tiny) checkpoint: batched results against single-sequence
//! [`Engine::generate`], chunked prefill, cancellation, preemption, validation, seeded
//! sampling, shutdown and logits processors.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kimi_cpu::CpuBackend;
use kimi_engine::sampling::SamplingParams;
use kimi_engine::{
    Engine, EngineHandle, EngineMetrics, Event, FinishReason, LogitsProcessor, Request, RequestId,
    ServingConfig, SubmitError,
};
use kimi_model::KimiLinear;
use kimi_weights::Checkpoint;
use tokio::sync::mpsc::UnboundedReceiver;

const FIXTURE: &str = "../../fixtures/kimi-linear/hub-bf16-released-like";
const DEADLINE: Duration = Duration::from_secs(30);

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
        block_size: 16,
        num_blocks: 1024,
        max_waiting: 64,
        expert_rebalance: None,
    }
}

fn spawn(config: ServingConfig) -> EngineHandle {
    EngineHandle::spawn(model(), config).expect("engine starts")
}

/// Deterministic prompt of `len` ids in `3..256`, different for each `seed`.
fn prompt(seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| 3 + ((seed * 7919 + i * 104_729 + i * i * 31) % 253) as u32)
        .collect()
}

/// Greedy, with the chosen token's logprob reported (its bits stand for the logits row).
fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        logprobs: Some(0),
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

/// Everything one request reported.
#[derive(Debug, Default)]
struct Outcome {
    started: bool,
    tokens: Vec<u32>,
    /// Bit patterns of each token's logprob: equal bits mean equal logits rows.
    logprob_bits: Vec<u32>,
    finish: Option<FinishReason>,
    completion_tokens: usize,
    error: Option<String>,
}

/// Next event, failing the test instead of hanging.
fn next_event(rx: &mut UnboundedReceiver<Event>) -> Option<Event> {
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(event) => return Some(event),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => return None,
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(start.elapsed() < DEADLINE, "no event within {DEADLINE:?}");
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

fn collect(rx: &mut UnboundedReceiver<Event>) -> Outcome {
    collect_from(rx, Outcome::default())
}

/// [`collect`] after [`wait_started`] took the `Started` event.
fn collect_rest(rx: &mut UnboundedReceiver<Event>) -> Outcome {
    collect_from(
        rx,
        Outcome {
            started: true,
            ..Outcome::default()
        },
    )
}

fn collect_from(rx: &mut UnboundedReceiver<Event>, mut out: Outcome) -> Outcome {
    while let Some(event) = next_event(rx) {
        match event {
            Event::Started { queued_secs } => {
                assert!(
                    !out.started && out.tokens.is_empty(),
                    "Started comes once, first"
                );
                assert!(queued_secs >= 0.0);
                out.started = true;
            }
            Event::Token(t) => {
                assert!(out.started, "a token before Started");
                out.tokens.push(t.token);
                out.logprob_bits.push(t.logprob.to_bits());
            }
            Event::Finished {
                reason,
                completion_tokens,
                ..
            } => {
                out.finish = Some(reason);
                out.completion_tokens = completion_tokens;
                break;
            }
            Event::Error(e) => {
                out.error = Some(e);
                break;
            }
            Event::Beams(b) => panic!("a sampled request reported beams: {b:?}"),
        }
    }
    out
}

fn wait_started(rx: &mut UnboundedReceiver<Event>) {
    match next_event(rx) {
        Some(Event::Started { .. }) => {}
        other => panic!("expected Started, got {other:?}"),
    }
}

/// Polls the metrics until `ok` holds.
fn wait_metrics(
    engine: &EngineHandle,
    what: &str,
    ok: impl Fn(&EngineMetrics) -> bool,
) -> EngineMetrics {
    let start = Instant::now();
    loop {
        let m = engine.metrics();
        if ok(&m) {
            return m;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "metrics never showed {what}: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What `Engine::generate` gives for one sequence.
fn reference(
    engine: &Engine<CpuBackend>,
    prompt: &[u32],
    params: &SamplingParams,
) -> (Vec<u32>, FinishReason) {
    let g = engine
        .generate(prompt, params, &eos_ids(), |_| ControlFlow::Continue(()))
        .expect("generates");
    (g.tokens.iter().map(|s| s.token).collect(), g.finish)
}

/// A logits processor that blocks in `mask` until the test lets a step through (one `()`
/// per step, or dropping the sender opens it for good), and counts accepted tokens.
struct Gate {
    go: mpsc::Receiver<()>,
    accepted: Arc<AtomicUsize>,
}

fn gated(
    prompt: Vec<u32>,
    params: SamplingParams,
) -> (Request, mpsc::Sender<()>, Arc<AtomicUsize>) {
    let (tx, go) = mpsc::channel();
    let accepted = Arc::new(AtomicUsize::new(0));
    let gate = Gate {
        go,
        accepted: Arc::clone(&accepted),
    };
    let req = Request {
        logits_processor: Some(Box::new(gate)),
        ..request(prompt, params)
    };
    (req, tx, accepted)
}

impl LogitsProcessor for Gate {
    fn mask(&mut self, _logits: &mut [f32]) {
        let _ = self.go.recv();
    }
    fn accept(&mut self, _token: u32) -> Result<(), String> {
        self.accepted.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn is_finished(&self) -> bool {
        false
    }
}

#[test]
fn the_handle_is_clone_send_and_sync() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    check::<EngineHandle>();
}

/// Plain greedy requests (no logprobs, no penalties) have their tokens picked by the
/// backend (`argmax_rows`, only ids come back); they must be the tokens the host sampler
/// picks from the same logits, batched or alone.
#[test]
fn backend_greedy_picks_the_samplers_tokens() {
    let single = Engine::new(model());
    let plain = |max_tokens| SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    };
    let cases: Vec<(Vec<u32>, usize)> =
        (0..12).map(|i| (prompt(i, 1 + (i * 29) % 50), 8)).collect();
    let want: Vec<_> = cases
        .iter()
        .map(|(p, n)| reference(&single, p, &greedy(*n)))
        .collect();
    let engine = spawn(config());
    let mut rxs: Vec<_> = cases
        .iter()
        .map(|(p, n)| {
            engine
                .submit(request(p.clone(), plain(*n)))
                .expect("accepted")
                .1
        })
        .collect();
    for (i, (rx, (tokens, finish))) in rxs.iter_mut().zip(&want).enumerate() {
        let out = collect(rx);
        assert_eq!(&out.tokens, tokens, "request {i}");
        assert_eq!(out.finish, Some(*finish), "request {i}");
        assert!(
            out.logprob_bits.iter().all(|&b| f32::from_bits(b).is_nan()),
            "request {i}: no logprob was asked for"
        );
    }
}

#[test]
fn batched_greedy_equals_single_sequence_generate() {
    let single = Engine::new(model());
    let cases: Vec<(Vec<u32>, SamplingParams)> = (0..32)
        .map(|i| (prompt(i, 1 + (i * 37) % 60), greedy(5 + (i * 7) % 16)))
        .collect();
    let lens: Vec<usize> = cases.iter().map(|c| c.0.len()).collect();
    assert!(lens.contains(&1) && lens.iter().all(|&n| n <= 60));

    let t = Instant::now();
    let want: Vec<_> = cases
        .iter()
        .map(|(p, s)| {
            let g = single
                .generate(p, s, &eos_ids(), |_| ControlFlow::Continue(()))
                .expect("generates");
            let bits: Vec<u32> = g.tokens.iter().map(|t| t.logprob.to_bits()).collect();
            (
                g.tokens.iter().map(|t| t.token).collect::<Vec<u32>>(),
                g.finish,
                bits,
            )
        })
        .collect();
    let single_secs = t.elapsed().as_secs_f64();

    let engine = spawn(config());
    let t = Instant::now();
    let mut rxs: Vec<_> = cases
        .iter()
        .map(|(p, s)| {
            engine
                .submit(request(p.clone(), s.clone()))
                .expect("accepted")
                .1
        })
        .collect();
    let got: Vec<Outcome> = rxs.iter_mut().map(collect).collect();
    let batched_secs = t.elapsed().as_secs_f64();

    let mut fed_tokens = 0;
    for (i, (out, (tokens, finish, bits))) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            &out.tokens,
            tokens,
            "request {i} (prompt {} tokens)",
            cases[i].0.len()
        );
        // Bitwise: a row's logits do not depend on the other rows of its batch.
        assert_eq!(&out.logprob_bits, bits, "request {i}: logprobs differ");
        assert_eq!(out.finish, Some(*finish), "request {i}");
        assert_eq!(out.completion_tokens, tokens.len());
        fed_tokens +=
            cases[i].0.len() + tokens.len() - usize::from(*finish == FinishReason::Length);
    }
    let generated: usize = want.iter().map(|w| w.0.len()).sum();
    eprintln!(
        "32 requests, {generated} tokens: batched {batched_secs:.3}s ({:.0} tok/s), one at a time {single_secs:.3}s ({:.0} tok/s)",
        generated as f64 / batched_secs,
        generated as f64 / single_secs
    );
    let m = wait_metrics(&engine, "an idle engine", |m| {
        m.num_running == 0 && m.num_waiting == 0
    });
    assert_eq!(m.generation_tokens_total as usize, generated);
    assert_eq!(m.prompt_tokens_total as usize, lens.iter().sum::<usize>());
    assert_eq!(m.cache_usage, 0.0);
    // Six MoE layers, two experts per token each; the dense first layer counts nothing.
    let top_k = 2;
    assert!(m.expert_counts[0].is_empty());
    for layer in &m.expert_counts[1..] {
        assert_eq!(layer.iter().sum::<u64>() as usize, top_k * fed_tokens);
    }
    engine.shutdown(true);
}

#[test]
fn chunked_prefill_under_a_tiny_budget_equals_unchunked() {
    let unchunked = Engine::new(model());
    let mut chunked = Engine::new(model());
    chunked.prefill_chunk = 8;
    let cfg = ServingConfig {
        max_num_batched_tokens: 8,
        max_num_seqs: 4,
        ..config()
    };

    // Alone, the 45-token prompt goes through in chunks of 8: exactly `prefill_chunk = 8`.
    let engine = spawn(cfg.clone());
    let long = prompt(1, 45);
    let (_, mut rx) = engine
        .submit(request(long.clone(), greedy(12)))
        .expect("accepted");
    let out = collect(&mut rx);
    let want = reference(&chunked, &long, &greedy(12));
    assert_eq!(out.tokens, want.0);
    assert_eq!(reference(&unchunked, &long, &greedy(12)).0, want.0);

    // Together, chunk boundaries depend on the other requests; the greedy tokens do not.
    let prompts = [prompt(2, 45), prompt(3, 30), prompt(4, 17), prompt(5, 3)];
    let mut rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(request(p.clone(), greedy(10)))
                .expect("accepted")
                .1
        })
        .collect();
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        assert_eq!(collect(rx).tokens, reference(&unchunked, p, &greedy(10)).0);
    }
    engine.shutdown(true);
}

#[test]
fn cancellation_frees_capacity_for_a_waiting_request() {
    // 16 blocks of 4 tokens: A (40 tokens, 10 blocks) and B (30 tokens, 8 blocks) cannot
    // both hold their prompts.
    let cfg = ServingConfig {
        max_model_len: 64,
        block_size: 4,
        num_blocks: 16,
        max_num_seqs: 4,
        ..config()
    };
    let engine = spawn(cfg);
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(20)
    };
    let (req_a, gate_a, _) = gated(prompt(1, 40), params.clone());
    let (id_a, mut rx_a) = engine.submit(req_a).expect("accepted");
    wait_started(&mut rx_a);
    let (req_b, gate_b, _) = gated(prompt(2, 30), greedy(5));
    let (_, mut rx_b) = engine.submit(req_b).expect("accepted");
    gate_a.send(()).expect("A waits at its gate");
    // A's 41 tokens hold 11 blocks; B's 8 do not fit in the other 5.
    wait_metrics(&engine, "B waiting behind A", |m| {
        m.num_waiting == 1 && m.num_running == 1 && m.cache_usage == 11.0 / 16.0
    });

    engine.cancel(id_a);
    engine.cancel(id_a);
    drop(gate_a);
    wait_started(&mut rx_b);
    let m = wait_metrics(&engine, "B admitted", |m| m.num_waiting == 0);
    assert_eq!(m.num_running, 1);
    assert_eq!(m.cache_usage, 8.0 / 16.0, "only B's 8 blocks are held");

    let a = collect_rest(&mut rx_a);
    assert_eq!(a.finish, Some(FinishReason::Cancelled));
    assert_eq!(a.completion_tokens, a.tokens.len());
    assert!(a.tokens.len() < 20);
    drop(gate_b);
    let b = collect_rest(&mut rx_b);
    assert!(
        matches!(b.finish, Some(FinishReason::Length | FinishReason::Stop)),
        "{b:?}"
    );
    // B's blocks are mostly A's, stale rows included: its tokens are those it gets alone.
    let (want, _) = reference(&Engine::new(model()), &prompt(2, 30), &greedy(5));
    assert_eq!(b.tokens, want);
    let m = wait_metrics(&engine, "an idle engine", |m| m.num_running == 0);
    assert_eq!(m.cache_usage, 0.0);
    engine.shutdown(true);
}

#[test]
fn dropping_the_receiver_cancels_the_request() {
    let engine = spawn(config());
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(100)
    };
    let (req, gate, accepted) = gated(prompt(1, 20), params);
    let (_, mut rx) = engine.submit(req).expect("accepted");
    wait_started(&mut rx);
    drop(rx);
    drop(gate);
    let m = wait_metrics(&engine, "the request gone", |m| {
        m.num_running == 0 && m.num_waiting == 0
    });
    assert_eq!(m.cache_usage, 0.0);
    assert!(
        accepted.load(Ordering::SeqCst) <= 2,
        "generation went on after the client left"
    );
    assert!(m.generation_tokens_total <= 2);
    engine.shutdown(true);
}

#[test]
fn preemption_by_recompute_keeps_greedy_tokens() {
    let single = Engine::new(model());
    // 64 cached tokens in all, six requests of up to 40 tokens each: preempted and finished
    // requests' blocks go to others (out of order, stale rows included).
    let cfg = ServingConfig {
        max_model_len: 64,
        block_size: 4,
        num_blocks: 16,
        max_num_seqs: 8,
        ..config()
    };
    let engine = spawn(cfg);
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(20)
    };
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(10 + i, 10 + 2 * i)).collect();
    let mut rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(request(p.clone(), params.clone()))
                .expect("accepted")
                .1
        })
        .collect();
    for (i, (p, rx)) in prompts.iter().zip(&mut rxs).enumerate() {
        let out = collect(rx);
        let (tokens, finish) = reference(&single, p, &params);
        assert_eq!(out.tokens, tokens, "request {i}");
        assert_eq!(out.finish, Some(finish));
    }
    let m = engine.metrics();
    assert!(
        m.num_preemptions_total > 0,
        "the test should preempt: {m:?}"
    );
    assert_eq!(m.cache_usage, 0.0);
    engine.shutdown(true);
}

#[test]
fn invalid_requests_and_a_full_queue_are_refused() {
    let engine = spawn(ServingConfig {
        max_model_len: 32,
        max_num_seqs: 1,
        max_waiting: 2,
        expert_rebalance: None,
        ..config()
    });
    let invalid =
        |prompt: Vec<u32>, params: SamplingParams| match engine.submit(request(prompt, params)) {
            Err(SubmitError::Invalid(message)) => message,
            other => panic!("expected Invalid, got {:?}", other.map(|(id, _)| id)),
        };
    assert!(invalid(vec![], greedy(4)).contains("no tokens"));
    assert!(invalid(prompt(0, 32), greedy(4)).contains("32 tokens"));
    assert!(invalid(vec![5, 256], greedy(4)).contains("256"));
    assert!(invalid(
        prompt(0, 4),
        SamplingParams {
            temperature: -1.0,
            ..greedy(4)
        }
    )
    .contains("temperature"));
    assert!(invalid(
        prompt(0, 4),
        SamplingParams {
            top_p: f32::NAN,
            ..greedy(4)
        }
    )
    .contains("top_p"));
    assert!(invalid(prompt(0, 4), greedy(0)).contains("max_tokens"));

    // One running (held at its gate), two waiting: the third waiter is refused.
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(20)
    };
    let (req, gate, _) = gated(prompt(1, 8), params.clone());
    let (_, mut rx_a) = engine.submit(req).expect("accepted");
    wait_started(&mut rx_a);
    let (_, mut rx_b) = engine
        .submit(request(prompt(2, 8), params.clone()))
        .expect("accepted");
    let (_, mut rx_c) = engine
        .submit(request(prompt(3, 8), params.clone()))
        .expect("accepted");
    match engine.submit(request(prompt(4, 8), params.clone())) {
        Err(SubmitError::QueueFull(2)) => {}
        other => panic!("expected QueueFull(2), got {:?}", other.map(|(id, _)| id)),
    }
    // Shut down while A is held: once submissions are refused the command is queued, so
    // A cannot finish on its own before it.
    let stopper = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.shutdown(false))
    };
    let start = Instant::now();
    while !matches!(
        engine.submit(request(prompt(5, 8), params.clone())),
        Err(SubmitError::ShuttingDown)
    ) {
        assert!(start.elapsed() < DEADLINE, "shutdown never started");
        std::thread::yield_now();
    }
    drop(gate);
    stopper.join().expect("shutdown returns");
    assert_eq!(
        collect_rest(&mut rx_a).finish,
        Some(FinishReason::Cancelled)
    );
    for rx in [&mut rx_b, &mut rx_c] {
        assert_eq!(collect(rx).finish, Some(FinishReason::Cancelled));
    }
}

#[test]
fn invalid_configurations_are_refused() {
    let bad = [
        ServingConfig {
            max_num_seqs: 0,
            ..config()
        },
        ServingConfig {
            max_num_batched_tokens: 16,
            max_num_seqs: 32,
            ..config()
        },
        ServingConfig {
            num_blocks: 15,
            block_size: 16,
            max_model_len: 256,
            ..config()
        },
        ServingConfig {
            max_model_len: (1 << 20) + 1,
            num_blocks: 1 << 20,
            ..config()
        },
    ];
    for cfg in bad {
        let err = EngineHandle::spawn(model(), cfg.clone()).expect_err("refused");
        assert!(
            err.to_string().contains("invalid serving configuration"),
            "{cfg:?}: {err}"
        );
    }
}

#[test]
fn seeded_sampling_is_reproducible_across_batch_compositions() {
    let single = Engine::new(model());
    let params = |seed| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: Some(seed),
        ignore_eos: true,
        ..greedy(16)
    };
    let target = prompt(7, 13);
    let want = reference(&single, &target, &params(1234)).0;

    let engine = spawn(config());
    let (_, mut rx) = engine
        .submit(request(target.clone(), params(1234)))
        .expect("accepted");
    assert_eq!(collect(&mut rx).tokens, want, "alone");

    let others: Vec<(Vec<u32>, u64)> = (0..10)
        .map(|i| (prompt(20 + i, 5 + 3 * i), i as u64))
        .collect();
    let mut rxs: Vec<_> = others
        .iter()
        .map(|(p, s)| {
            engine
                .submit(request(p.clone(), params(*s)))
                .expect("accepted")
                .1
        })
        .collect();
    let (_, mut rx) = engine
        .submit(request(target.clone(), params(1234)))
        .expect("accepted");
    assert_eq!(collect(&mut rx).tokens, want, "in a batch of 11");
    for ((p, s), rx) in others.iter().zip(&mut rxs) {
        assert_eq!(
            collect(rx).tokens,
            reference(&single, p, &params(*s)).0,
            "seed {s}"
        );
    }
    engine.shutdown(true);
}

#[test]
fn graceful_shutdown_finishes_running_requests() {
    let single = Engine::new(model());
    let engine = spawn(config());
    let cases: Vec<(Vec<u32>, SamplingParams)> = (0..4)
        .map(|i| (prompt(30 + i, 6 + 5 * i), greedy(12)))
        .collect();
    let mut rxs: Vec<_> = cases
        .iter()
        .map(|(p, s)| {
            engine
                .submit(request(p.clone(), s.clone()))
                .expect("accepted")
                .1
        })
        .collect();
    engine.shutdown(true);
    assert!(matches!(
        engine.submit(request(prompt(1, 4), greedy(4))),
        Err(SubmitError::ShuttingDown)
    ));
    for ((p, s), rx) in cases.iter().zip(&mut rxs) {
        let out = collect(rx);
        let (tokens, finish) = reference(&single, p, s);
        assert_eq!(out.tokens, tokens);
        assert_eq!(out.finish, Some(finish));
    }
    engine.shutdown(true);
}

#[test]
fn immediate_shutdown_cancels_running_requests() {
    let engine = spawn(ServingConfig {
        max_model_len: 8192,
        num_blocks: 1024,
        block_size: 16,
        ..config()
    });
    let (_, mut rx) = engine
        .submit(request(
            prompt(1, 10),
            SamplingParams {
                ignore_eos: true,
                ..greedy(5000)
            },
        ))
        .expect("accepted");
    wait_started(&mut rx);
    engine.shutdown(false);
    let out = collect_rest(&mut rx);
    assert_eq!(out.finish, Some(FinishReason::Cancelled));
    assert!(out.tokens.len() < 5000);
    assert_eq!(engine.metrics().num_running, 0);
}

/// Allows only `token`, and is complete after `len` of them.
struct Only {
    token: u32,
    len: usize,
    seen: usize,
}

impl LogitsProcessor for Only {
    fn mask(&mut self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            if id != self.token as usize {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, token: u32) -> Result<(), String> {
        if token != self.token {
            return Err(format!("token {token} is not allowed"));
        }
        self.seen += 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.seen >= self.len
    }
}

#[test]
fn a_logits_processor_forces_its_token_and_ends_generation() {
    let engine = spawn(config());
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(3),
        ..greedy(10)
    };
    let only = Only {
        token: 77,
        len: 4,
        seen: 0,
    };
    let req = Request {
        logits_processor: Some(Box::new(only)),
        ..request(prompt(1, 9), params)
    };
    let (_, mut rx) = engine.submit(req).expect("accepted");
    let out = collect(&mut rx);
    assert_eq!(out.tokens, vec![77; 4]);
    assert_eq!(out.finish, Some(FinishReason::Stop));

    // A processor that rejects what it allowed ends its request with an error, and only it.
    let broken = Only {
        token: 77,
        len: 4,
        seen: 0,
    };
    struct Liar(Only);
    impl LogitsProcessor for Liar {
        fn mask(&mut self, logits: &mut [f32]) {
            self.0.mask(logits)
        }
        fn accept(&mut self, _token: u32) -> Result<(), String> {
            Err("the grammar cannot continue".into())
        }
        fn is_finished(&self) -> bool {
            false
        }
    }
    let req = Request {
        logits_processor: Some(Box::new(Liar(broken))),
        ..request(prompt(2, 9), greedy(10))
    };
    let (_, mut rx_bad) = engine.submit(req).expect("accepted");
    let (_, mut rx_ok) = engine
        .submit(request(prompt(3, 9), greedy(6)))
        .expect("accepted");
    assert_eq!(
        collect(&mut rx_bad).error.as_deref(),
        Some("the grammar cannot continue")
    );
    assert!(collect(&mut rx_ok).finish.is_some());

    // A processor that panics fails its request; the engine thread survives.
    struct Panics;
    impl LogitsProcessor for Panics {
        fn mask(&mut self, _logits: &mut [f32]) {
            panic!("constraint bug");
        }
        fn accept(&mut self, _token: u32) -> Result<(), String> {
            Ok(())
        }
        fn is_finished(&self) -> bool {
            false
        }
    }
    let req = Request {
        logits_processor: Some(Box::new(Panics)),
        ..request(prompt(4, 9), greedy(10))
    };
    let (_, mut rx_panics) = engine.submit(req).expect("accepted");
    let error = collect(&mut rx_panics).error.expect("an error event");
    assert!(error.contains("constraint bug"), "{error}");
    let (_, mut rx_after) = engine
        .submit(request(prompt(5, 9), greedy(4)))
        .expect("accepted");
    assert_eq!(collect(&mut rx_after).tokens.len(), 4);
    engine.shutdown(true);
}

#[test]
fn request_ids_are_distinct_and_cancel_is_idempotent() {
    let engine = spawn(config());
    let (a, mut rx_a) = engine
        .submit(request(prompt(1, 5), greedy(3)))
        .expect("accepted");
    let (b, mut rx_b) = engine
        .submit(request(prompt(2, 5), greedy(3)))
        .expect("accepted");
    assert_ne!(a, b);
    collect(&mut rx_a);
    collect(&mut rx_b);
    engine.cancel(a);
    engine.cancel(RequestId(9999));
    let (_, mut rx_c) = engine
        .submit(request(prompt(3, 5), greedy(3)))
        .expect("accepted");
    assert!(collect(&mut rx_c).finish.is_some());
    engine.shutdown(true);
    engine.cancel(b);
}
