//! The top-k log-probability file of `perplexity --save-logits` and the KL divergence that
//! `perplexity --kl-divergence` computes from it (layout: docs/kld-format.md).
//!
//! llama.cpp's `--kl-divergence-base` stores every log-probability (as u16); this file keeps
//! the `k` most likely tokens of each scored position and one more bucket for the rest of the
//! vocabulary, so it stays small for large vocabularies. The divergence is then the exact KL
//! between the two distributions coarsened to those k + 1 outcomes, a lower bound on the
//! full-vocabulary KL that is tight when the reference's top k hold nearly all of its mass.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

const MAGIC: &[u8; 8] = b"KIMIKLD1";
/// llama.cpp's `perplexity --kl-divergence-base` file.
const LLAMA_CPP_MAGIC: &[u8; 8] = b"_logits_";

/// What a saved file must agree on with the run that reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KldHeader {
    pub vocab: u32,
    pub ctx: u32,
    pub chunks: u32,
    pub top_k: u32,
    /// Every window's tokens as evaluated (BOS already in place), `chunks * ctx` ids.
    pub tokens: Vec<u32>,
}

/// One scored position of the reference: its top-k ids and log-probabilities (most likely
/// first) and the log of the probability of every other token together.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    pub rest_logprob: f64,
}

impl TopK {
    /// The `k` most likely tokens of a row of log-probabilities (ties: lower id first).
    pub fn of(logprobs: &[f64], k: usize) -> TopK {
        let k = k.min(logprobs.len());
        let mut order: Vec<u32> = (0..logprobs.len() as u32).collect();
        let by_prob = |a: &u32, b: &u32| {
            logprobs[*b as usize]
                .total_cmp(&logprobs[*a as usize])
                .then(a.cmp(b))
        };
        if k < order.len() {
            order.select_nth_unstable_by(k, by_prob);
            order.truncate(k);
        }
        order.sort_unstable_by(by_prob);
        let top: Vec<f64> = order.iter().map(|&i| logprobs[i as usize]).collect();
        let rest_logprob = log_sum_exp_except(logprobs, &order);
        TopK {
            ids: order,
            logprobs: top,
            rest_logprob,
        }
    }
}

/// log Σ exp(logprobs[i]) over the ids not in `skip` (-inf when none is left).
fn log_sum_exp_except(logprobs: &[f64], skip: &[u32]) -> f64 {
    let mut skipped = vec![false; logprobs.len()];
    for &i in skip {
        skipped[i as usize] = true;
    }
    let rest = || {
        logprobs
            .iter()
            .zip(&skipped)
            .filter(|(_, s)| !**s)
            .map(|(v, _)| *v)
    };
    let max = rest().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + rest().map(|v| (v - max).exp()).sum::<f64>().ln()
}

/// Writes a header, then the reference's positions one by one.
pub struct KldWriter {
    out: BufWriter<std::fs::File>,
    path: PathBuf,
    top_k: usize,
}

impl KldWriter {
    pub fn create(path: &Path, header: &KldHeader) -> anyhow::Result<KldWriter> {
        let file =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = KldWriter {
            out: BufWriter::new(file),
            path: path.to_path_buf(),
            top_k: header.top_k as usize,
        };
        let mut bytes = MAGIC.to_vec();
        for v in [header.vocab, header.ctx, header.chunks, header.top_k] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        for t in &header.tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        w.write(&bytes)?;
        Ok(w)
    }

    pub fn push(&mut self, top: &TopK) -> anyhow::Result<()> {
        anyhow::ensure!(
            top.ids.len() == self.top_k,
            "top-k rows must have k entries"
        );
        let mut bytes = Vec::with_capacity(self.top_k * 12 + 8);
        for (id, lp) in top.ids.iter().zip(&top.logprobs) {
            bytes.extend_from_slice(&id.to_le_bytes());
            bytes.extend_from_slice(&lp.to_le_bytes());
        }
        bytes.extend_from_slice(&top.rest_logprob.to_le_bytes());
        self.write(&bytes)
    }

    pub fn finish(mut self) -> anyhow::Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }

    fn write(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.out
            .write_all(bytes)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Reads a saved file position by position: ours, or llama.cpp's `--kl-divergence-base`
/// file (every log-probability as u16), whose rows are cut to their top `k` as ours are.
pub struct KldReader {
    input: BufReader<std::fs::File>,
    path: PathBuf,
    pub header: KldHeader,
    /// u16 values per row of a llama.cpp file (`None` for ours).
    llama_cpp_row: Option<usize>,
}

impl KldReader {
    /// Opens `path`; a llama.cpp file's rows are cut to their `top_k` likeliest tokens.
    pub fn open(path: &Path, top_k: usize) -> anyhow::Result<KldReader> {
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        let mut input = BufReader::new(file);
        let mut magic = [0u8; 8];
        input
            .read_exact(&mut magic)
            .with_context(|| format!("reading {}", path.display()))?;
        if &magic == LLAMA_CPP_MAGIC {
            return Self::open_llama_cpp(input, path, len, top_k);
        }
        anyhow::ensure!(
            &magic == MAGIC,
            "{} is neither a file of `kimi-infer perplexity --save-logits` nor one of \
             llama.cpp's `llama-perplexity --kl-divergence-base`",
            path.display()
        );
        let mut fields = [0u32; 4];
        for f in &mut fields {
            *f = read_u32(&mut input, path)?;
        }
        let [vocab, ctx, chunks, top_k] = fields;
        let n_tokens = ctx as usize * chunks as usize;
        let mut tokens = Vec::with_capacity(n_tokens);
        for _ in 0..n_tokens {
            tokens.push(read_u32(&mut input, path)?);
        }
        Ok(KldReader {
            input,
            path: path.to_path_buf(),
            header: KldHeader {
                vocab,
                ctx,
                chunks,
                top_k,
                tokens,
            },
            llama_cpp_row: None,
        })
    }

    /// llama.cpp's layout (`tools/perplexity/perplexity.cpp`): after the magic, u32 `n_ctx`,
    /// i32 `n_vocab`, i32 `n_chunk`, the i32 tokens of every window, then per scored token
    /// `2·⌈n_vocab/2⌉ + 4` u16: f32 `scale` and `min_log_prob`, then each token's
    /// log-probability as `scale · v + min_log_prob`, 0 for tokens more than 16 below the
    /// likeliest logit. The size must be exactly that (no allocation from a bad header).
    fn open_llama_cpp(
        mut input: BufReader<std::fs::File>,
        path: &Path,
        len: u64,
        top_k: usize,
    ) -> anyhow::Result<KldReader> {
        let name = path.display();
        let [ctx, vocab, chunks] = [(); 3].map(|_| read_u32(&mut input, path));
        let (ctx, vocab, chunks) = (ctx?, vocab?, chunks?);
        anyhow::ensure!(
            ctx >= 2 && (1..1 << 30).contains(&vocab) && chunks >= 1 && vocab as usize >= top_k,
            "{name}: a llama.cpp log-probability file with n_ctx {ctx}, n_vocab {vocab} and \
             {chunks} chunks cannot be read (top-k {top_k})"
        );
        let row = 2 * (vocab as u64).div_ceil(2) + 4;
        let scored = u64::from(ctx - 1 - ctx / 2);
        let want =
            20 + 4 * u64::from(ctx) * u64::from(chunks) + 2 * row * scored * u64::from(chunks);
        anyhow::ensure!(
            len == want,
            "{name}: {len} bytes, but a llama.cpp log-probability file of {chunks} windows of \
             {ctx} tokens over {vocab} ids has {want}"
        );
        let tokens = (0..ctx as usize * chunks as usize)
            .map(|_| read_u32(&mut input, path))
            .collect::<anyhow::Result<Vec<u32>>>()?;
        Ok(KldReader {
            input,
            path: path.to_path_buf(),
            header: KldHeader {
                vocab,
                ctx,
                chunks,
                top_k: top_k as u32,
                tokens,
            },
            llama_cpp_row: Some(row as usize),
        })
    }

    /// One row of a llama.cpp file as log-probabilities (in f32, as llama.cpp computes
    /// them), those at or below −16 as impossible (llama.cpp's KL skips them too; the
    /// floor of a row whose logits span more than 16 lies there), cut to the top `k`.
    fn next_llama_cpp(&mut self, row: usize) -> anyhow::Result<TopK> {
        let mut bytes = vec![0u8; 2 * row];
        self.input
            .read_exact(&mut bytes)
            .with_context(|| format!("{} ends early", self.path.display()))?;
        let f32_at =
            |i: usize| f32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let (scale, min_log_prob) = (f32_at(0), f32_at(4));
        let logprobs: Vec<f64> = bytes[8..8 + 2 * self.header.vocab as usize]
            .chunks_exact(2)
            .map(|b| {
                let lp = scale * f32::from(u16::from_le_bytes([b[0], b[1]])) + min_log_prob;
                if lp > -16.0 {
                    f64::from(lp)
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        anyhow::ensure!(
            logprobs.iter().all(|v| !v.is_nan() && *v <= 1e-3),
            "{}: a row's log-probabilities are not log-probabilities (scale {scale}, \
             minimum {min_log_prob})",
            self.path.display()
        );
        Ok(TopK::of(&logprobs, self.header.top_k as usize))
    }

    pub fn next(&mut self) -> anyhow::Result<TopK> {
        if let Some(row) = self.llama_cpp_row {
            return self.next_llama_cpp(row);
        }
        let k = self.header.top_k as usize;
        let mut top = TopK {
            ids: Vec::with_capacity(k),
            logprobs: Vec::with_capacity(k),
            rest_logprob: 0.0,
        };
        for _ in 0..k {
            let id = read_u32(&mut self.input, &self.path)?;
            anyhow::ensure!(
                id < self.header.vocab,
                "{}: token id {id} is outside its vocabulary of {}",
                self.path.display(),
                self.header.vocab
            );
            top.ids.push(id);
            top.logprobs.push(read_f64(&mut self.input, &self.path)?);
        }
        top.rest_logprob = read_f64(&mut self.input, &self.path)?;
        Ok(top)
    }
}

fn read_u32(r: &mut impl Read, path: &Path) -> anyhow::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)
        .with_context(|| format!("{} ends early", path.display()))?;
    Ok(u32::from_le_bytes(b))
}

fn read_f64(r: &mut impl Read, path: &Path) -> anyhow::Result<f64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)
        .with_context(|| format!("{} ends early", path.display()))?;
    Ok(f64::from_le_bytes(b))
}

/// Running sums of the KL divergence and top-token agreement.
#[derive(Debug, Default, Clone)]
pub struct KldStats {
    sum: f64,
    sum_sq: f64,
    same_top: u64,
    count: u64,
}

/// The figures llama.cpp's `--kl-divergence` prints, from our top-k files.
#[derive(Debug, Clone, Copy)]
pub struct KldSummary {
    pub mean: f64,
    pub mean_stderr: f64,
    pub same_top: f64,
    pub same_top_stderr: f64,
    pub count: u64,
}

impl KldStats {
    /// Adds one position: `reference` from the file, `logprobs` this model's full row.
    pub fn push(&mut self, reference: &TopK, logprobs: &[f64]) {
        let top_ids: Vec<u32> = reference.ids.clone();
        let mut kl = 0.0;
        for (&id, &lp) in reference.ids.iter().zip(&reference.logprobs) {
            // 0 · log 0 = 0 (a llama.cpp row's floor tokens are impossible).
            if lp > f64::NEG_INFINITY {
                kl += lp.exp() * (lp - logprobs[id as usize]);
            }
        }
        let p_rest = reference.rest_logprob.exp();
        if p_rest > 0.0 {
            kl += p_rest * (reference.rest_logprob - log_sum_exp_except(logprobs, &top_ids));
        }
        self.sum += kl;
        self.sum_sq += kl * kl;
        self.count += 1;
        if reference.ids.first() == Some(&argmax(logprobs)) {
            self.same_top += 1;
        }
    }

    pub fn summary(&self) -> KldSummary {
        let n = self.count as f64;
        let mean = self.sum / n;
        let same_top = self.same_top as f64 / n;
        // Standard errors of a mean as llama.cpp gives them: sqrt(variance / (n - 1)).
        let stderr = |variance: f64| {
            if self.count > 1 {
                (variance.max(0.0) / (n - 1.0)).sqrt()
            } else {
                0.0
            }
        };
        KldSummary {
            mean,
            mean_stderr: stderr(self.sum_sq / n - mean * mean),
            same_top,
            same_top_stderr: stderr(same_top * (1.0 - same_top)),
            count: self.count,
        }
    }
}

/// The most likely token (the lowest id among ties, as [`TopK::of`] orders them).
fn argmax(logprobs: &[f64]) -> u32 {
    let mut best = 0;
    for (i, v) in logprobs.iter().enumerate() {
        if *v > logprobs[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_softmax(logits: &[f64]) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        logits.iter().map(|v| v - lse).collect()
    }

    #[test]
    fn top_k_keeps_the_likeliest_and_the_rest_sums_to_one() {
        let lp = log_softmax(&[0.5, 3.0, -1.0, 3.0, 2.0]);
        let top = TopK::of(&lp, 2);
        assert_eq!(top.ids, vec![1, 3]);
        let total: f64 = top.logprobs.iter().map(|v| v.exp()).sum::<f64>() + top.rest_logprob.exp();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
    }

    /// A llama.cpp `--kl-divergence-base` file of `rows` (one window of `ctx` tokens),
    /// each row stored as llama.cpp's `log_softmax` stores it.
    fn llama_cpp_file(dir: &Path, ctx: u32, rows: &[Vec<f32>]) -> PathBuf {
        let vocab = rows[0].len();
        let mut bytes = b"_logits_".to_vec();
        for v in [ctx, vocab as u32, 1] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        for t in 0..ctx {
            bytes.extend_from_slice(&(t % vocab as u32).to_le_bytes());
        }
        for logits in rows {
            let max = logits.iter().cloned().fold(f32::MIN, f32::max);
            let min = logits
                .iter()
                .cloned()
                .fold(f32::MAX, f32::min)
                .max(max - 16.0);
            let sum: f64 = logits.iter().map(|l| f64::from((l - max).exp())).sum();
            let lse = sum.ln() as f32;
            let scale = (max - min) / 65535.0;
            bytes.extend_from_slice(&scale.to_le_bytes());
            bytes.extend_from_slice(&(min - max - lse).to_le_bytes());
            let mut q: Vec<u16> = logits
                .iter()
                .map(|&l| {
                    if l > min {
                        ((l - min) / scale).round() as u16
                    } else {
                        0
                    }
                })
                .collect();
            q.resize(2 * vocab.div_ceil(2), 0);
            for v in q {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        let path = dir.join("base.kld");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn llama_cpp_base_files_read_as_top_k_rows() {
        let dir = std::env::temp_dir().join(format!("kimi-kld-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // ctx 6 scores 6 - 3 - 1 = 2 rows; 5 ids (odd: the row is padded to 6 + 4 u16).
        let rows = vec![
            vec![0.5, 3.0, -1.0, 2.5, -30.0],
            vec![1.0, 1.5, 0.0, -2.0, 4.0],
        ];
        let path = llama_cpp_file(&dir, 6, &rows);
        let mut r = KldReader::open(&path, 2).unwrap();
        assert_eq!((r.header.vocab, r.header.ctx, r.header.chunks), (5, 6, 1));
        assert_eq!(r.header.tokens, vec![0, 1, 2, 3, 4, 0]);
        for logits in &rows {
            let exact = log_softmax(&logits.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
            let top = r.next().unwrap();
            let want = TopK::of(&exact, 2);
            assert_eq!(top.ids, want.ids);
            for (a, b) in top.logprobs.iter().zip(&want.logprobs) {
                assert!((a - b).abs() < 1e-3, "{a} vs {b}");
            }
            // The rest holds the others' mass, the -30 logit (below the floor) excluded.
            assert!((top.rest_logprob.exp() - want.rest_logprob.exp()).abs() < 1e-3);
            let mut stats = KldStats::default();
            stats.push(&top, &exact);
            assert!(stats.summary().mean.abs() < 1e-3, "{:?}", stats.summary());
        }
        assert!(r.next().is_err(), "read past the end");
        // A file cut short is refused by its size, before anything is allocated from it.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let err = KldReader::open(&path, 2).err().unwrap().to_string();
        assert!(err.contains("base.kld") && err.contains("bytes"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kl_is_zero_against_itself_and_matches_the_coarse_formula() {
        let p = log_softmax(&[1.0, 2.0, 0.0, -1.0]);
        let q = log_softmax(&[2.0, 1.0, 0.5, -0.5]);
        let top = TopK::of(&p, 2);
        let mut same = KldStats::default();
        same.push(&top, &p);
        assert_eq!(same.summary().mean, 0.0);
        assert_eq!(same.summary().same_top, 1.0);
        let mut other = KldStats::default();
        other.push(&top, &q);
        // Outcomes {1}, {0}, {2, 3} under p and q.
        let coarse = |lp: &[f64]| [lp[1].exp(), lp[0].exp(), lp[2].exp() + lp[3].exp()];
        let (pc, qc) = (coarse(&p), coarse(&q));
        let expected: f64 = pc.iter().zip(&qc).map(|(a, b)| a * (a / b).ln()).sum();
        assert!((other.summary().mean - expected).abs() < 1e-12);
        assert_eq!(other.summary().same_top, 0.0);
    }
}
