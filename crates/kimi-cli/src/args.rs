//! Command-line arguments (plain data; validated where they are used).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Run Kimi models on your own hardware.
#[derive(Parser, Debug)]
#[command(name = "kimi-infer", version, about, propagate_version = true)]
pub struct Cli {
    /// Worker threads for the CPU backend (default: one per core).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// Log lines on stderr as text (colours only on a terminal) or JSON objects; KIMI_LOG
    /// sets what is logged (e.g. `info`, `warn,kimi_server::access=info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-12-03T12:00:00Z  INFO target: message key=value ...`
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for a prompt and stream it to stdout.
    Run(RunArgs),
    /// Interactive multi-turn chat using the model's chat template.
    Chat(ChatArgs),
    /// Write the logits of every position of a token-id sequence as a NumPy .npy file.
    Logits(LogitsArgs),
    /// Perplexity of a text as llama.cpp's `llama-perplexity` measures it, and the KL
    /// divergence from a reference model's saved top-k log-probabilities.
    Perplexity(PerplexityArgs),
    /// Print the architecture, parameter counts, weight bytes and cache sizes of a model.
    Inspect(InspectArgs),
    /// Whether and how a model fits a machine (GPUs, host RAM, disk), and the decode
    /// tokens/s its bandwidths allow.
    Plan(PlanArgs),
    /// Measure prefill and decode speed and peak memory.
    Bench(BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API with continuous batching.
    Serve(ServeArgs),
    /// One OpenAI-compatible front door for several servers: health checks, least-loaded
    /// routing with conversation affinity, API keys and limits, a response cache.
    Gateway(crate::gateway::GatewayArgs),
    /// Convert a Kimi Linear checkpoint (or a config with random weights) to a llama.cpp GGUF
    /// (architecture `kimi-linear`), or a llama GGUF to a Hugging Face checkpoint.
    Convert(ConvertArgs),
    /// Quantize a float checkpoint (round to nearest, GPTQ or AWQ) into a compressed-tensors
    /// `pack-quantized` checkpoint, as llm-compressor writes one.
    Quantize(QuantizeArgs),
    /// Agents: tools (shell, REST, MCP, code) run in a loop around a model, served as
    /// OpenAI's Responses API (`agent serve`) or for one task (`agent run`).
    Agent(crate::agent::args::AgentArgs),
    /// Download a model repository from the Hugging Face hub (or HF_ENDPOINT) into the hub's
    /// cache, checksummed and resumable; prints the folder that `--model` then opens.
    Download(DownloadArgs),
}

/// `kimi-infer quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Checkpoint directory (config.json + safetensors) with float weights: a Kimi model or
    /// a `LlamaForCausalLM` (e.g. from `convert --to safetensors`).
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Quantization method: `rtn` (round to nearest, compressed-tensors' min-max rules),
    /// `gptq` (rounding errors spread by the inputs' Hessian) or `awq` (activation-aware
    /// channel scales folded into the preceding norm or matrix, then clipped rounding); the
    /// last two need --calibration-text.
    #[arg(long, default_value = "rtn", value_parser = ["rtn", "gptq", "awq"])]
    pub method: String,
    /// Bits per weight: 4 (asymmetric, with zero points, unless --symmetric) or 8
    /// (symmetric).
    #[arg(long, default_value_t = 4)]
    pub bits: u32,
    /// Input columns per scale; -1 for one scale per row. Matrices whose width it does not
    /// divide stay as they are (and are listed in the config's `ignore`).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub group_size: i64,
    /// Symmetric 4-bit codes (no zero points).
    #[arg(long)]
    pub symmetric: bool,
    /// The text the model reads to learn each matrix's inputs (gptq, awq), e.g.
    /// models/corpus/lcet10.txt from scripts/fetch_corpus.sh.
    #[arg(long)]
    pub calibration_text: Option<PathBuf>,
    /// Tokens of the calibration text to read (whole windows).
    #[arg(long, default_value_t = 16384)]
    pub calibration_tokens: usize,
    /// Tokens per calibration window.
    #[arg(long, default_value_t = 512)]
    pub calibration_ctx: usize,
    /// GiB of input statistics (k² · 4 bytes per matrix) one pass over the text may hold;
    /// more layers take more passes.
    #[arg(long, default_value_t = 8.0)]
    pub calibration_memory_gb: f64,
    /// GPTQ's column order: `static` (largest input energy first, groups kept contiguous:
    /// llm-compressor's `actorder: static`) or `none` (left to right).
    #[arg(long, default_value = "static", value_parser = ["static", "none"])]
    pub actorder: String,
    /// GPTQ layer by layer: each layer calibrated on the outputs of the layers before it as
    /// quantized (llm-compressor's sequential pipeline), instead of all layers from the float
    /// model in one pass; reads the text once per layer.
    #[arg(long)]
    pub sequential: bool,
    /// GPTQ's damping of the Hessian's diagonal, relative to its mean.
    #[arg(long, default_value_t = 0.01)]
    pub damp: f64,
    /// Output directory (created; must be empty, unless --resume).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Finish an interrupted run into the same --out with the same arguments: shards already
    /// written are kept, the rest are redone.
    #[arg(long)]
    pub resume: bool,
    /// GB of tensors per output shard (whole layers; `model-0000N-of-0000M.safetensors`).
    #[arg(long, default_value_t = 5.0)]
    pub max_shard_gb: f64,
}

/// `kimi-infer download`.
#[derive(Args, Debug)]
pub struct DownloadArgs {
    /// Repository id, `org/name` (e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct).
    pub repo_id: String,
    /// Only these files (exact names in the repository; same as --include).
    pub files: Vec<String>,
    /// Branch, tag or commit.
    #[arg(long, default_value = kimi_hub::DEFAULT_REVISION)]
    pub revision: String,
    /// Only files matching these patterns (repeatable; `*` also matches `/`, a trailing `/`
    /// takes a whole folder), as huggingface_hub's allow_patterns.
    #[arg(long, num_args = 1.., value_name = "GLOB")]
    pub include: Vec<String>,
    /// Skip files matching these patterns (repeatable), as huggingface_hub's ignore_patterns.
    #[arg(long, num_args = 1.., value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Write plain files into this folder instead of the cache (huggingface_hub's local_dir).
    #[arg(long)]
    pub local_dir: Option<PathBuf>,
    /// The hub cache [default: HF_HUB_CACHE, else $HF_HOME/hub, else
    /// ~/.cache/huggingface/hub].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Token for gated or private repositories [default: HF_TOKEN, else the token
    /// `hf auth login` saved].
    #[arg(long)]
    pub token: Option<String>,
    /// Files transferred at once.
    #[arg(long, default_value_t = 8)]
    pub max_workers: usize,
}

/// `kimi-infer convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Checkpoint directory (config.json + safetensors), or a cached hub repository
    /// `org/name[@revision]`; with `--to safetensors`, a llama GGUF file.
    #[arg(long, short = 'm', required_unless_present = "random_config")]
    pub model: Option<PathBuf>,
    /// Convert a config.json with deterministic random bf16 weights (those of `bench
    /// --random-config`) instead of a checkpoint; the file gets a byte-level stand-in
    /// vocabulary (ids 0-255 are bytes, the rest special tokens) so llama.cpp loads it.
    #[arg(long, conflicts_with = "model")]
    pub random_config: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ConvertFormat::Gguf)]
    pub to: ConvertFormat,
    /// Tensor types: llama.cpp's converter for f32/f16/bf16/q8_0, llama-quantize's mixture
    /// for q4_k_m (`--to safetensors`: f32, f16 or bf16, every tensor). Kimi K3's routed
    /// experts stay MXFP4 (ggml blocks, the checkpoint's codes unchanged) in every case.
    #[arg(long, value_enum, default_value_t = QuantArg::F16)]
    pub quant: QuantArg,
    /// Output file (`--to safetensors`: a new or empty directory).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

/// Formats `convert` writes.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvertFormat {
    /// GGUF with llama.cpp's `kimi-linear` (or, for Kimi K3, `kimi-k3`) names, shapes and
    /// metadata.
    Gguf,
    /// A Hugging Face `LlamaForCausalLM` checkpoint (config.json, model.safetensors,
    /// tokenizer.json, tokenizer_config.json) from a llama GGUF, its weights dequantized.
    Safetensors,
}

/// Tensor types of a converted GGUF.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum QuantArg {
    /// Everything f32.
    F32,
    /// Matrices f16.
    F16,
    /// Matrices bf16.
    Bf16,
    /// Matrices Q8_0.
    #[value(name = "q8_0")]
    Q8_0,
    /// llama.cpp's Q4_K_M mixture (Q4_K, Q6_K for output and some attn_v/ffn_down).
    #[value(name = "q4_k_m")]
    Q4KM,
}

/// `kimi-infer serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name clients send and /v1/models lists (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + output per request (default: the model's context, at most 32768).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens per forward pass; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Bytes for the cache pool instead of a share of memory (vLLM's flag; units as in
    /// 4GiB, 500MB; a plain number is bytes); still capped at what --max-num-seqs
    /// sequences of --max-model-len tokens use.
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory_bytes: Option<u64>,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Cache blocks to allocate, instead of sizing the pool from free memory (refused when
    /// larger than the memory left).
    #[arg(long)]
    pub num_gpu_blocks_override: Option<usize>,
    /// With `--enable-expert-parallel`, move routed experts between the ranks while
    /// serving (vLLM's flag): every --eplb-step-interval steps the experts chosen in those
    /// steps are counted, and where a placement that evens out each rank's tokens beats the
    /// one in use by --eplb-min-gain, the ranks read the experts they take on and switch
    /// between two steps. Every rank keeps as many experts; requests in flight go on.
    #[arg(long, requires = "enable_expert_parallel")]
    pub enable_eplb: bool,
    /// Engine steps between looks at the routing counts (`--enable-eplb`).
    #[arg(
        long,
        value_name = "STEPS",
        default_value_t = 3000,
        requires = "enable_eplb"
    )]
    pub eplb_step_interval: u64,
    /// How much better balanced (the largest rank's routed tokens over the mean) a new
    /// placement must be before experts move: 0.05 is 5 % (`--enable-eplb`).
    #[arg(
        long,
        value_name = "FRACTION",
        default_value_t = 0.05,
        requires = "enable_eplb"
    )]
    pub eplb_min_gain: f64,
    #[command(flatten)]
    pub keys: crate::access_args::KeyArgs,
    #[command(flatten)]
    pub tls: crate::access_args::TlsArgs,
    #[command(flatten)]
    pub cors: crate::access_args::CorsArgs,
    /// Chat template file (Jinja) replacing the tokenizer's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// How the model writes tool calls: auto (detected from the tokenizer and the chat
    /// template), kimi, hermes, llama3_json, mistral or generic.
    #[arg(long, default_value = "auto", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: kimi_server::ToolCallParser,
    /// Serve a config.json with deterministic random bf16 weights (benchmarks of full-size
    /// shapes without a checkpoint); needs --tokenizer.
    #[arg(long, conflicts_with = "model", requires = "tokenizer")]
    pub random_config: Option<PathBuf>,
    /// Tokenizer directory (tiktoken.model or tokenizer.json) instead of the model's own,
    /// or a cached hub repository `org/name[@revision]`.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Seconds a connection may take to send a complete request head, counted from when
    /// it opens or from its previous response: closes idle keep-alive connections and
    /// half-sent requests (0: never).
    #[arg(long, default_value_t = 5.0, value_parser = parse_secs)]
    pub timeout_keep_alive: f64,
    /// Seconds a request body may take to arrive after its head; later: 408 (0: never).
    #[arg(long, default_value_t = 60.0, value_parser = parse_secs)]
    pub timeout_body: f64,
    /// Seconds a request may take end to end; later: 408, or a stream ends with an error
    /// (0: no limit).
    #[arg(long, default_value_t = 600.0, value_parser = parse_secs)]
    pub request_timeout: f64,
    /// Most connections open at once; past it, new connections get 503 with Retry-After
    /// (a `GET /health` still gets 200). Default: 1024, lowered to fit the open-file limit.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds SIGTERM / Ctrl-C lets running requests finish before their connections are
    /// closed (0: wait for them). A second signal exits at once.
    #[arg(long, default_value_t = 30.0, value_parser = parse_secs)]
    pub shutdown_timeout: f64,
}

pub(crate) fn parse_tool_call_parser(name: &str) -> Result<kimi_server::ToolCallParser, String> {
    name.parse()
}

/// Seconds: a finite number, at least 0.
pub fn parse_secs(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if (0.0..1e9).contains(&s) => Ok(s),
        _ => Err(format!("`{text}` is not a number of seconds (0 or more)")),
    }
}

/// Where the model comes from.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json + safetensors) or GGUF file (llama-family,
    /// kimi-linear or kimi-k3), or a Hugging Face repository `org/name[@revision][/file.gguf]` found in
    /// the hub's cache (see `kimi-infer download`). Without it, the built-in demo model
    /// (tiny, random weights: its text is gibberish) is used.
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// When --model names a repository that is not in the cache, download it (all its
    /// files, or the one file named) from the hub instead of failing.
    #[arg(long)]
    pub download: bool,
    /// Multiply block-quantized weights (GGUF types, and Kimi K3's MXFP4 experts) against
    /// activations quantized to int8 per 32 values (as llama.cpp does): decode batches of up
    /// to 8 tokens, and every batch on x86 CPUs with AVX2 or AVX-512 VNNI (weights interleaved
    /// for their kernels): several times faster, but greedy choices between near-tied tokens
    /// can change. Off by default: products are then those of the dequantized weights in f32.
    #[arg(long)]
    pub int8_matmul: bool,
    /// Storage of the key/value cache. MLA latent caches (Kimi): `auto` (f32) or `fp8`
    /// (E4M3, each cached row with its own scales for the latent and the rope key: 3.9x
    /// fewer bytes on Kimi Linear; logits move by the FP8 rounding). Attention caches
    /// (Llama-family GGUF files and checkpoints): `auto` (f16 with `--int8-matmul`, else
    /// f32), `f16` (llama.cpp's default `-ctk f16 -ctv f16`: half the bytes of f32) or
    /// `f32`. CUDA takes `auto`, `f32` and `fp8` (MLA latent caches only). KDA's recurrent
    /// state stays f32.
    #[arg(long, default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: kimi_ops::KvCacheDtype,
    /// Device to run on: `cpu`, `cuda` or `cuda:N` (GPU N; needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// CUDA: round activations to bf16 before each tensor-core product (GEMMs, MoE experts,
    /// MLA prefill attention), as bf16 engines do. Faster prefill, ~3e-3 relative error per
    /// product. Off by default: each f32 activation then enters as two bf16 terms, which
    /// keeps products near f32 accuracy at twice the tensor-core work.
    #[arg(long)]
    pub bf16_activations: bool,
    /// Fraction of memory the weights and caches may use: of the GPU's memory (default
    /// 0.9), or on the CPU of the memory this process may still take, the smaller of
    /// MemAvailable and the cgroup's limit less its use (default 0.5). The cache pool is
    /// never larger than --max-num-seqs sequences of --max-model-len tokens. On a GPU,
    /// when no offload flag is given and the weights would take more than 85 % of this
    /// share, routed experts go to host RAM automatically (see --cpu-offload-gb).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Routed experts beyond the device's memory.
    #[command(flatten)]
    pub offload: crate::offload::OffloadArgs,
    /// The model split over several ranks.
    #[command(flatten)]
    pub parallel: crate::parallel::ParallelArgs,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend on this GPU ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (expected cpu, cuda or cuda:N)")),
        }
    }
}

/// Sampling flags shared by `run` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalise tokens already present in prompt or output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtract this times the token's count in the output (OpenAI semantics).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Subtract this if the token already appeared in the output.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Random seed: the same seed gives the same output.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Stop when this text appears (repeatable); the text itself is not printed.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Stop on this token id (repeatable).
    #[arg(long = "stop-id")]
    pub stop_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print each token's log-probability and this many alternatives to stderr (0–20).
    #[arg(long)]
    pub logprobs: Option<usize>,
}

/// `kimi-infer run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Beam search with this many beams instead of sampling (temperature 0): prints the
    /// best beam, and every beam with its score to stderr.
    #[arg(long)]
    pub num_beams: Option<usize>,
    /// Beam search: a finished beam scores sum(logprob) / length^X (X > 0 favours longer).
    #[arg(long, default_value_t = 1.0, requires = "num_beams")]
    pub length_penalty: f32,
    /// Beam search: stop once num-beams beams have finished, without waiting for better
    /// ones to be impossible.
    #[arg(long, requires = "num_beams")]
    pub early_stopping: bool,
    /// Print prompt and generation speed to stderr at the end.
    #[arg(long)]
    pub stats: bool,
}

/// `kimi-infer chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System message for the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// KDA kernel form, for checking that every path agrees.
#[derive(ValueEnum, Clone, Copy, Debug, Default)]
pub enum KdaModeArg {
    /// Chunked for several tokens, recurrent for one.
    #[default]
    Auto,
    /// Token-by-token recurrence.
    Recurrent,
    /// Chunked (WY) form everywhere.
    Chunked,
}

/// MLA attention form.
#[derive(ValueEnum, Clone, Copy, Debug, Default)]
pub enum MlaModeArg {
    /// Expanded for several tokens, absorbed for one.
    #[default]
    Auto,
    /// Per-head keys and values.
    Expanded,
    /// Attention in the latent space.
    Absorbed,
}

/// `kimi-infer logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids, e.g. 5,17,42.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Output .npy file (float32, shape [tokens, vocab]).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Feed the ids through the caches this many at a time (1 = decode path). Default: all at once.
    #[arg(long)]
    pub step: Option<usize>,
    /// KDA kernel form.
    #[arg(long, value_enum, default_value_t = KdaModeArg::Auto)]
    pub kda_mode: KdaModeArg,
    /// MLA attention form.
    #[arg(long, value_enum, default_value_t = MlaModeArg::Auto)]
    pub mla_mode: MlaModeArg,
}

/// `kimi-infer perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (UTF-8), e.g. the corpus scripts/fetch_corpus.sh fetches.
    #[arg(long, short = 'f')]
    pub text: PathBuf,
    /// Tokens per window (llama.cpp's `--ctx-size`); the second half of each is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Tokens per forward pass within a window (default: the whole window at once).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Score at most this many windows (default: every whole window of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Also write the per-window estimates and the final figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Save each scored token's top-k log-probabilities (and the rest's) for a later
    /// `--kl-divergence` run (format: docs/kld-format.md).
    #[arg(long, alias = "kl-divergence-base", conflicts_with = "kl_divergence")]
    pub save_logits: Option<PathBuf>,
    /// How many log-probabilities `--save-logits` keeps per token.
    #[arg(long, default_value_t = 32)]
    pub top_k: usize,
    /// Compare against a file `--save-logits` wrote, or one of llama.cpp's
    /// `llama-perplexity --kl-divergence-base` (same text, tokenizer and --ctx): mean KL
    /// divergence, its standard error, and how often the top token agrees.
    #[arg(long)]
    pub kl_divergence: Option<PathBuf>,
}

/// `kimi-infer inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kimi-infer plan`. Sizes are GiB unless they carry a unit (`141GB`, `141GiB`, `1.5TB`);
/// bandwidths are GB/s. The defaults describe an 8 × H200 node (141 GiB each) with 560 GiB of
/// RAM and 235 GiB of free disk.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Checkpoint directory or config.json (only the config is read), or a cached hub
    /// repository `org/name[@revision]`.
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// GPUs, tensor parallel for the non-expert weights and expert parallel for the routed
    /// experts (0: the CPU holds and computes everything).
    #[arg(long, default_value_t = 8)]
    pub gpus: u64,
    /// Memory per GPU, GiB unless given a unit as every size here may be (141GB, 1.5TB,
    /// 512MiB). H200: 141 (nvidia-smi shows 143,771 MiB).
    #[arg(long, default_value = "141", value_parser = parse_size)]
    pub gpu_mem: u64,
    /// Memory per GPU kept free for the CUDA context, workspaces and activations.
    #[arg(long, default_value = "2", value_parser = parse_size)]
    pub gpu_reserve: u64,
    /// Host RAM.
    #[arg(long, default_value = "560", value_parser = parse_size)]
    pub ram: u64,
    /// Host RAM kept free for the system and the process.
    #[arg(long, default_value = "16", value_parser = parse_size)]
    pub ram_reserve: u64,
    /// Free disk space.
    #[arg(long, default_value = "235", value_parser = parse_size)]
    pub disk: u64,
    /// Sequences decoded together: the caches are sized for them; the rooflines are given at
    /// batch 1, 64 and this one.
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// Tokens each sequence holds (its MLA cache).
    #[arg(long, default_value_t = 8192)]
    pub context: u64,
    /// Memory bandwidth of one GPU, GB/s (H200 datasheet: 4,800).
    #[arg(long, default_value_t = 4800.0)]
    pub gpu_bw: f64,
    /// Host-to-GPU bandwidth of one GPU's link, GB/s (PCIe 5.0 x16, pinned copies: 55).
    #[arg(long, default_value_t = 55.0)]
    pub pcie_bw: f64,
    /// Host memory read bandwidth, all sockets, GB/s (2 × 8 channels of DDR5-4800: 614).
    #[arg(long, default_value_t = 614.0)]
    pub ram_bw: f64,
    /// Disk read bandwidth, GB/s (one PCIe 4.0 NVMe drive: 7).
    #[arg(long, default_value_t = 7.0)]
    pub disk_bw: f64,
    /// A `kimi-infer bench` JSON of a run with experts in host RAM on the machine being
    /// planned: its measured costs of an expert miss (`offload_miss_costs`: one slot fill,
    /// the CPU computing one expert) replace the host-to-GPU link bandwidth and give the rate
    /// at which the CPU computes experts (otherwise host RAM bandwidth, a ceiling).
    #[arg(long, value_name = "BENCH.json")]
    pub measured: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A byte count: GiB without a unit, else B, kB/MB/GB/TB (powers of 1000) or
/// KiB/MiB/GiB/TiB (powers of 1024; K/M/G/T alone mean these too).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 141, 141GiB, 141GB, 1.5TB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "g" | "gib" => (1u64 << 30) as f64,
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => (1u64 << 20) as f64,
        "t" | "tib" => (1u64 << 40) as f64,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}` (GB, GiB, TB, TiB, ...)"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// A byte count for `--kv-cache-memory-bytes`: as [`parse_size`], but a plain number is
/// bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse()
            .map_err(|_| format!("`{text}` is too large for a byte count"));
    }
    parse_size(t)
}

/// `kimi-infer bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens for the prefill measurement (comma-separated list: one run each).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub prompt_len: Vec<usize>,
    /// Tokens per prefill forward pass (default: 512 on the CPU, 8192 on a GPU).
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Also time decode steps of this many sequences at once (comma-separated list), each
    /// sequence first prefilled with --context tokens; straight through the model, no scheduler.
    #[arg(long, value_delimiter = ',')]
    pub decode_batch: Vec<usize>,
    /// Context each sequence holds before the --decode-batch steps are timed.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Timed decode steps per --decode-batch size (the median is reported).
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Tokens to decode for the decode measurement.
    #[arg(long, default_value_t = 32)]
    pub gen_len: usize,
    /// Timed repetitions of each measurement, single requests and --batch waves alike (the
    /// best is reported).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also measure offline throughput of this many concurrent requests through the
    /// continuous-batching engine (the baseline for server overhead).
    #[arg(long, default_value_t = 0)]
    pub batch: usize,
    /// Benchmark a config.json with deterministic random weights instead of a checkpoint.
    #[arg(long, conflicts_with = "model")]
    pub random_config: Option<PathBuf>,
    /// Stored dtype of the random weights.
    #[arg(long, value_enum, default_value_t = RandomDType::Bf16)]
    pub random_dtype: RandomDType,
    /// With --random-config: make the random routers prefer some experts, a Zipf-like
    /// skew (each layer's selection bias lowered by SKEW · ln(rank + 1) over a random
    /// ranking of its experts); 0 routes about uniformly, the worst case for expert caches.
    /// The measured concentration is printed with each decode batch.
    #[arg(long, default_value_t = 0.0, value_parser = parse_skew)]
    pub routing_skew: f32,
}

fn parse_skew(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(v) if v.is_finite() && (0.0..=100.0).contains(&v) => Ok(v),
        _ => Err(format!("`{text}` is not a skew between 0 and 100")),
    }
}

/// Weight dtype for `bench --random-config`.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum RandomDType {
    /// bfloat16 (as released checkpoints).
    Bf16,
    /// f32.
    F32,
    /// The linear layers 4-bit (Q4Z: integer zero points, 32-value groups), as AWQ and GPTQ
    /// checkpoints have them; embeddings, LM head, norms and routers bf16.
    Q4z,
}

impl RandomDType {
    /// The stored dtype it names.
    pub fn dtype(self) -> kimi_core::DType {
        match self {
            Self::Bf16 => kimi_core::DType::BF16,
            Self::F32 => kimi_core::DType::F32,
            Self::Q4z => kimi_core::DType::Q4Z,
        }
    }
}

/// `--kv-cache-dtype`: `auto`, `fp8` (vLLM's `fp8_e4m3` too), `f16` or `f32` (llama.cpp's
/// `-ctk`/`-ctv` names; `float16`/`fp16` and `float32`/`fp32` too).
fn parse_kv_cache_dtype(text: &str) -> Result<kimi_ops::KvCacheDtype, String> {
    match text {
        "auto" => Ok(kimi_ops::KvCacheDtype::Auto),
        "fp8" | "fp8_e4m3" => Ok(kimi_ops::KvCacheDtype::Fp8),
        "f16" | "fp16" | "float16" | "half" => Ok(kimi_ops::KvCacheDtype::F16),
        "f32" | "fp32" | "float32" | "float" => Ok(kimi_ops::KvCacheDtype::F32),
        other => Err(format!(
            "`{other}` is not a cache dtype (auto, f16, f32, fp8)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_kv_cache_dtype, parse_size};
    use kimi_ops::KvCacheDtype;

    #[test]
    fn cache_dtypes_take_vllm_and_llama_cpp_names() {
        for (text, want) in [
            ("auto", KvCacheDtype::Auto),
            ("fp8", KvCacheDtype::Fp8),
            ("fp8_e4m3", KvCacheDtype::Fp8),
            ("f16", KvCacheDtype::F16),
            ("float16", KvCacheDtype::F16),
            ("f32", KvCacheDtype::F32),
            ("fp32", KvCacheDtype::F32),
        ] {
            assert_eq!(parse_kv_cache_dtype(text), Ok(want), "{text}");
        }
        assert_eq!(KvCacheDtype::F16.name(), "f16");
        let err = parse_kv_cache_dtype("q8_0").unwrap_err();
        assert!(err.contains("q8_0") && err.contains("f16"), "{err}");
    }

    #[test]
    fn sizes_are_gib_unless_they_say_otherwise() {
        assert_eq!(parse_size("141"), Ok(141 << 30));
        assert_eq!(parse_size("141GiB"), Ok(141 << 30));
        assert_eq!(parse_size("141 gb"), Ok(141_000_000_000));
        assert_eq!(parse_size("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("0.5"), Ok(1 << 29));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert!(parse_size("12XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("GB").is_err());
        assert!(parse_size("-3").is_err());
        assert!(parse_size("1e30TB").is_err());
        assert_eq!(super::parse_bytes("4096"), Ok(4096));
        assert_eq!(super::parse_bytes("4GiB"), Ok(4 << 30));
        assert!(super::parse_bytes("99999999999999999999999").is_err());
    }
}
