//! Sampling parameters shared by `/v1/chat/completions` and `/v1/completions`: OpenAI's
//! fields plus vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`,
//! `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, and beam search:
//! `use_beam_search`, `best_of`, `length_penalty`, `early_stopping`).

use kimi_engine::beam::BeamParams;
use kimi_engine::sampling::{SamplingError, SamplingParams};

use crate::error::ApiError;
use crate::fields::{bad_value, wrong_type, Body};

/// The most choices one request may ask for (`n`), as OpenAI.
pub(crate) const MAX_N: i64 = 128;

/// Request fields common to both completion endpoints.
#[derive(Clone, Debug)]
pub(crate) struct CommonParams {
    /// Everything but `max_tokens` and `logprobs`, which [`finalize`] and the endpoint set.
    pub sampling: SamplingParams,
    /// `max_tokens` / `max_completion_tokens` as given.
    pub max_tokens: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    /// `logit_bias`: added to the logits of these tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// Leave special tokens out of the text (vLLM's `skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
}

/// Reads the common fields. `max_tokens_fields` are tried in order (chat prefers
/// `max_completion_tokens`).
pub(crate) fn parse_common(
    body: &Body,
    vocab_size: usize,
    max_tokens_fields: &[&str],
) -> Result<CommonParams, ApiError> {
    let mut sampling = SamplingParams {
        temperature: body.f32("temperature")?.unwrap_or(1.0),
        top_p: body.f32("top_p")?.unwrap_or(1.0),
        min_p: body.f32("min_p")?.unwrap_or(0.0),
        repetition_penalty: body.f32("repetition_penalty")?.unwrap_or(1.0),
        frequency_penalty: body.f32("frequency_penalty")?.unwrap_or(0.0),
        presence_penalty: body.f32("presence_penalty")?.unwrap_or(0.0),
        // OpenAI seeds are int64; any value is a valid seed.
        seed: body.int("seed")?.map(|s| s as u64),
        stop: body.strings("stop")?,
        stop_token_ids: body.token_ids("stop_token_ids", vocab_size)?,
        ignore_eos: body.bool("ignore_eos")?.unwrap_or(false),
        ..SamplingParams::default()
    };
    // vLLM: -1 (and 0) turn top-k off.
    sampling.top_k = match body.int("top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(bad_value(
                "top_k",
                format!("must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    let mut max_tokens = None;
    for field in max_tokens_fields {
        if let Some(m) = body.int(field)? {
            if m < 1 {
                return Err(bad_value(field, format!("must be at least 1, got {m}")));
            }
            max_tokens.get_or_insert(usize::try_from(m).unwrap_or(usize::MAX));
        }
    }
    let n = body.int_in("n", 1, MAX_N)?.unwrap_or(1) as usize;
    let stream = body.bool("stream")?.unwrap_or(false);
    if body.bool("use_beam_search")?.unwrap_or(false) {
        sampling.beam = Some(parse_beams(body, n, stream)?);
        // Beams are ranked by log probability: temperature 0 unless the client says otherwise
        // (and then validation names it).
        sampling.temperature = body.f32("temperature")?.unwrap_or(0.0);
    } else if let Some(best_of) = body.int("best_of")? {
        if best_of != n as i64 {
            return Err(bad_value(
                "best_of",
                "is only supported with use_beam_search (or equal to n)",
            ));
        }
    }
    let include_usage = match body.object("stream_options")? {
        None => false,
        Some(_) if !stream => {
            return Err(bad_value(
                "stream_options",
                "is only allowed when `stream` is true",
            ))
        }
        Some(options) => match options.get("include_usage") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type("stream_options.include_usage", "a boolean", v)),
        },
    };
    Ok(CommonParams {
        sampling,
        max_tokens,
        n,
        stream,
        include_usage,
        logit_bias: parse_logit_bias(body, vocab_size)?,
        skip_special_tokens: body.bool("skip_special_tokens")?.unwrap_or(true),
    })
}

/// vLLM's beam search fields: `best_of` beams (default `n`), of which the `n` best are
/// returned, `length_penalty` and `early_stopping`.
fn parse_beams(body: &Body, n: usize, stream: bool) -> Result<BeamParams, ApiError> {
    if stream {
        return Err(bad_value(
            "stream",
            "is not supported with use_beam_search: the beams are only known at the end \
             (vLLM does not stream beam search either)",
        ));
    }
    let num_beams = match body.int("best_of")? {
        None => n,
        Some(b) if b < n as i64 => {
            return Err(bad_value(
                "best_of",
                format!("must be at least n ({n}) with use_beam_search, got {b}"),
            ))
        }
        Some(b) if b > MAX_N => {
            return Err(bad_value(
                "best_of",
                format!("must be at most {MAX_N}, got {b}"),
            ))
        }
        Some(b) => b as usize,
    };
    Ok(BeamParams {
        num_beams,
        num_return: n,
        length_penalty: body.f32("length_penalty")?.unwrap_or(1.0),
        early_stopping: body.bool("early_stopping")?.unwrap_or(false),
    })
}

/// `logit_bias`: `{"token id": bias}` with biases in `[-100, 100]`, as OpenAI.
fn parse_logit_bias(body: &Body, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = body.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id: u32 = match key.trim().parse::<u64>() {
            Ok(id) if id < vocab_size as u64 => id as u32,
            _ => {
                return Err(bad_value(
                    "logit_bias",
                    format!("has key {key:?}, which is not a token id in 0..{vocab_size}"),
                ))
            }
        };
        let bias = value
            .as_f64()
            .ok_or_else(|| wrong_type("logit_bias", "an object of numbers", value))?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(bad_value(
                "logit_bias",
                format!("biases must be in [-100, 100], got {bias}"),
            ));
        }
        biases.push((id, bias as f32));
    }
    Ok(biases)
}

/// Sets `max_tokens` for a prompt of `prompt_len` tokens and validates everything.
///
/// Without `max_tokens` the output may fill the context, capped at `default_max` when given.
/// `logprobs_param` names the request field that set `sampling.logprobs`.
pub(crate) fn finalize(
    common: &CommonParams,
    prompt_len: usize,
    max_model_len: usize,
    vocab_size: usize,
    default_max: Option<usize>,
    prompt_param: &str,
    logprobs_param: &str,
) -> Result<SamplingParams, ApiError> {
    if prompt_len == 0 {
        return Err(bad_value(prompt_param, "is empty: it has no tokens"));
    }
    if prompt_len >= max_model_len {
        let message = format!(
            "This model's maximum context length is {max_model_len} tokens. However, your \
             prompt has {prompt_len} tokens, which leaves no room for the completion."
        );
        return Err(ApiError::context_length_exceeded(message, prompt_param));
    }
    let room = max_model_len - prompt_len;
    let max_tokens = match common.max_tokens {
        Some(m) if m > room => {
            let message = format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the prompt, {m} in the completion). \
                 Please reduce the prompt or the completion length.",
                prompt_len.saturating_add(m)
            );
            return Err(ApiError::context_length_exceeded(message, prompt_param));
        }
        Some(m) => m,
        None => default_max.map_or(room, |d| d.min(room)),
    };
    let sampling = SamplingParams {
        max_tokens,
        ..common.sampling.clone()
    };
    sampling.validate(vocab_size).map_err(|err| {
        let SamplingError::Invalid { field, .. } = &err else {
            return ApiError::invalid(err.to_string(), None);
        };
        let param = match *field {
            "logprobs" => logprobs_param,
            // The engine's beam fields, as the request spells them.
            "num_beams" => "best_of",
            "num_return" => "n",
            other => other,
        };
        ApiError::invalid(err.to_string(), Some(param)).code("invalid_value")
    })?;
    Ok(sampling)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: &str) -> Result<CommonParams, ApiError> {
        let body = Body::parse(json.as_bytes())?;
        parse_common(&body, 100, &["max_completion_tokens", "max_tokens"])
    }

    #[test]
    fn parses_and_validates() {
        let c = common(r#"{"temperature": 0, "top_k": -1, "stop": "x", "max_tokens": 5, "n": 2}"#)
            .expect("valid");
        assert_eq!(c.sampling.temperature, 0.0);
        assert_eq!(c.sampling.top_k, 0);
        assert_eq!(c.sampling.stop, vec!["x".to_string()]);
        assert_eq!((c.max_tokens, c.n), (Some(5), 2));
        let s = finalize(&c, 10, 20, 100, None, "prompt", "logprobs").expect("fits");
        assert_eq!(s.max_tokens, 5);
        let err = finalize(&c, 18, 20, 100, None, "prompt", "logprobs").expect_err("too long");
        assert_eq!(err.code, Some("context_length_exceeded"));
        let err = common(r#"{"max_tokens": 0}"#).expect_err("zero");
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
        let err = common(r#"{"stream_options": {"include_usage": true}}"#).expect_err("no stream");
        assert_eq!(err.param.as_deref(), Some("stream_options"));
        let c = common(r#"{"top_p": 0}"#).expect("parses");
        let err = finalize(&c, 1, 20, 100, None, "prompt", "logprobs").expect_err("top_p 0");
        assert_eq!(err.param.as_deref(), Some("top_p"));
        assert!(common(r#"{"logit_bias": {"100": 1}}"#).is_err());
        let beams = common(
            r#"{"use_beam_search": true, "n": 2, "best_of": 3,
                "length_penalty": 0.5, "early_stopping": true}"#,
        )
        .expect("valid");
        assert_eq!(
            beams.sampling.temperature, 0.0,
            "beam search defaults to temperature 0"
        );
        assert_eq!(
            beams.sampling.beam,
            Some(BeamParams {
                num_beams: 3,
                num_return: 2,
                length_penalty: 0.5,
                early_stopping: true
            })
        );
        let err = common(r#"{"use_beam_search": true, "n": 3, "best_of": 2}"#).expect_err("n");
        assert_eq!(err.param.as_deref(), Some("best_of"));
        let err = common(r#"{"use_beam_search": true, "stream": true}"#).expect_err("stream");
        assert_eq!(err.param.as_deref(), Some("stream"));
        let err = common(r#"{"best_of": 2}"#).expect_err("best_of without beams");
        assert_eq!(err.param.as_deref(), Some("best_of"));
        assert!(common(r#"{"logit_bias": {"5": 101}}"#).is_err());
        assert_eq!(
            common(r#"{"logit_bias": {"5": -100}}"#)
                .map(|c| c.logit_bias)
                .ok(),
            Some(vec![(5, -100.0)])
        );
    }
}
