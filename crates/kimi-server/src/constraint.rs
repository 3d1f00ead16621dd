//! Constrained decoding with llguidance: JSON schemas (`response_format`) and forced tool
//! calls (`tool_choice` required or named: K2 section tokens, K3's XTML via
//! [`crate::xtml_grammar`], the text formats via [`crate::json_tool_grammar`]), plus `logit_bias` and token bans, all behind one
//! [`LogitsProcessor`] per sequence.
//!
//! The token trie is built from the tokenizer's raw token bytes; special tokens are
//! prefixed with `0xFF` (llguidance's marker), so a grammar can name them as
//! `<|tool_call_begin|>` and plain text can never produce them. The XTML markers count as
//! special even where a tokenizer marks them otherwise (K3's own config marks `<|sep|>`
//! `special: false`).

use std::sync::Arc;

use kimi_core::TokenId;
use kimi_engine::serving::LogitsProcessor;
use kimi_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::error::ServerError;
use crate::json_tool_grammar;
use crate::tool_format::JsonToolFormat;
use crate::tool_parser::{
    SECTION_BEGIN, SECTION_END, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_BEGIN, TOOL_CALL_END,
};
use crate::xtml_grammar;
use crate::xtml_output::XtmlTokens;

/// The most calls one constrained `tool_choice: "required"` turn may make.
pub(crate) const MAX_PARALLEL_CALLS: usize = 4;

/// Compiles grammars against one tokenizer. Built once per server.
pub(crate) struct Constraints {
    factory: ParserFactory,
    /// Whether the tokenizer has all five tool-call special tokens.
    has_tool_tokens: bool,
    /// Whether the tokenizer has the four XTML markers.
    has_xtml_tokens: bool,
}

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraints")
            .field("has_tool_tokens", &self.has_tool_tokens)
            .field("has_xtml_tokens", &self.has_xtml_tokens)
            .finish_non_exhaustive()
    }
}

/// JSON layout options: fixed separators and no free whitespace, so that a grammar leaves
/// the model no way to ramble between tokens.
pub(crate) fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

impl Constraints {
    /// Builds the token trie of `tokenizer` for a model with `vocab_size` logits.
    pub(crate) fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self, ServerError> {
        let num_tokens = vocab_size.max(tokenizer.vocab_size());
        let xtml = XtmlTokens::find(tokenizer);
        let xtml_ids = xtml.map(|t| t.ids()).unwrap_or_default();
        let words: Vec<Vec<u8>> = (0..num_tokens as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some(bytes)
                    if tokenizer.is_special(id) || (xtml.is_some() && xtml_ids.contains(&id)) =>
                {
                    let mut word = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    word.extend_from_slice(&bytes);
                    word
                }
                Some(bytes) => bytes,
                None => Vec::new(),
            })
            .collect();
        let eos_ids = tokenizer.eos_ids();
        let info = TokRxInfo {
            vocab_size: num_tokens as u32,
            tok_eos: eos_ids.first().copied().unwrap_or(0),
            tok_bos: tokenizer.bos_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let mut trie = TokTrie::from(&info, &words);
        if !eos_ids.is_empty() {
            trie = trie.with_eos_tokens(&eos_ids);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let caps = InferenceCapabilities::default();
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .map_err(|e| ServerError::Constraint(e.to_string()))?;
        factory.quiet();
        let has_tool_tokens = [
            SECTION_BEGIN,
            SECTION_END,
            TOOL_CALL_BEGIN,
            TOOL_CALL_ARGUMENT_BEGIN,
            TOOL_CALL_END,
        ]
        .iter()
        .all(|name| {
            tokenizer
                .token_id(name)
                .is_some_and(|id| tokenizer.is_special(id))
        });
        Ok(Constraints {
            factory,
            has_tool_tokens,
            has_xtml_tokens: xtml.is_some(),
        })
    }

    /// Whether tool calls can be constrained (the tokenizer has Kimi's tool-call tokens).
    #[cfg(test)]
    pub(crate) fn has_tool_tokens(&self) -> bool {
        self.has_tool_tokens
    }

    fn matcher(&self, grammar: TopLevelGrammar) -> Result<Matcher, String> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(err) => Err(err),
            None => Ok(matcher),
        }
    }

    /// A matcher for JSON matching `schema` (any JSON object when `None`).
    pub(crate) fn json(&self, schema: Option<&Value>) -> Result<Matcher, String> {
        let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
        if !schema.is_object() {
            return Err("a JSON schema must be an object".into());
        }
        self.matcher(TopLevelGrammar::from_json_schema(with_layout(schema)))
    }

    /// A matcher for one tool-call section calling the given tools (name, parameters
    /// schema): exactly one call when `single`, else one to [`MAX_PARALLEL_CALLS`].
    pub(crate) fn tool_calls(
        &self,
        tools: &[(&str, &Value)],
        single: bool,
    ) -> Result<Matcher, String> {
        if !self.has_tool_tokens {
            return Err("the model's tokenizer has no tool-call tokens".into());
        }
        let num_calls = if single { 1 } else { MAX_PARALLEL_CALLS };
        let mut lark = String::new();
        let mut tail = String::new();
        for i in (1..num_calls).rev() {
            tail = format!("(call_{i} {tail})?");
        }
        lark += &format!("start: {SECTION_BEGIN} call_0 {tail} {SECTION_END}\n");
        for i in 0..num_calls {
            let alternatives: Vec<String> = tools
                .iter()
                .enumerate()
                .map(|(t, (name, _))| {
                    format!("\"functions.{name}:{i}\" {TOOL_CALL_ARGUMENT_BEGIN} args_{t}")
                })
                .collect();
            lark += &format!(
                "call_{i}: {TOOL_CALL_BEGIN} ({}) {TOOL_CALL_END}\n",
                alternatives.join(" | ")
            );
        }
        for (t, (_, schema)) in tools.iter().enumerate() {
            let schema = serde_json::to_string(&with_layout((*schema).clone()))
                .map_err(|e| e.to_string())?;
            lark += &format!("args_{t}: %json {schema}\n");
        }
        self.matcher(TopLevelGrammar::from_lark(lark))
    }
}

impl Constraints {
    /// A matcher for forced calls in one of the text formats (see
    /// [`crate::json_tool_grammar`]).
    pub(crate) fn json_tool_calls(
        &self,
        format: &JsonToolFormat,
        tools: &[(&str, &Value)],
        single: bool,
    ) -> Result<Matcher, String> {
        let lark = json_tool_grammar::tool_calls(format, tools, single)?;
        self.matcher(TopLevelGrammar::from_lark(lark))
    }

    /// A matcher for an XTML tools section (see [`xtml_grammar::tool_calls`]), starting
    /// inside `think` when `thinking`, else inside `response`.
    pub(crate) fn xtml_tool_calls(
        &self,
        tools: &[(&str, &Value)],
        single: bool,
        thinking: bool,
    ) -> Result<Matcher, String> {
        if !self.has_xtml_tokens {
            return Err("the model's tokenizer has no XTML tokens".into());
        }
        let lark = xtml_grammar::tool_calls(tools, single, thinking)?;
        self.matcher(TopLevelGrammar::from_lark(lark))
    }

    /// A matcher for an XTML response holding JSON that matches `schema` (any JSON object
    /// when `None`).
    pub(crate) fn xtml_json(
        &self,
        schema: Option<&Value>,
        thinking: bool,
    ) -> Result<Matcher, String> {
        if !self.has_xtml_tokens {
            return Err("the model's tokenizer has no XTML tokens".into());
        }
        let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
        if !schema.is_object() {
            return Err("a JSON schema must be an object".into());
        }
        self.matcher(TopLevelGrammar::from_lark(xtml_grammar::json_response(
            &schema, thinking,
        )?))
    }
}

/// Everything that edits one sequence's logits: bias, bans, then the grammar's mask.
pub(crate) struct Processor {
    bias: Vec<(TokenId, f32)>,
    banned: Vec<TokenId>,
    grammar: Option<Matcher>,
    /// A grammar failure seen in `mask`, reported by the next `accept`.
    error: Option<String>,
}

impl Processor {
    /// `None` when there is nothing to do.
    pub(crate) fn build(
        bias: &[(TokenId, f32)],
        banned: &[TokenId],
        grammar: Option<Matcher>,
    ) -> Option<Box<dyn LogitsProcessor>> {
        if bias.is_empty() && banned.is_empty() && grammar.is_none() {
            return None;
        }
        Some(Box::new(Processor {
            bias: bias.to_vec(),
            banned: banned.to_vec(),
            grammar,
            error: None,
        }))
    }
}

impl LogitsProcessor for Processor {
    fn mask(&mut self, logits: &mut [f32]) {
        for &(id, bias) in &self.bias {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
        for &id in &self.banned {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
        let Some(matcher) = &mut self.grammar else {
            return;
        };
        match matcher.compute_mask() {
            Ok(allowed) => {
                allowed.iter_unset_entries(|id| {
                    if let Some(logit) = logits.get_mut(id) {
                        *logit = f32::NEG_INFINITY;
                    }
                });
                for logit in logits.iter_mut().skip(allowed.len()) {
                    *logit = f32::NEG_INFINITY;
                }
            }
            Err(err) => {
                self.error.get_or_insert_with(|| err.to_string());
            }
        }
    }

    fn accept(&mut self, token: TokenId) -> Result<(), String> {
        if let Some(err) = self.error.take() {
            return Err(format!("constrained decoding failed: {err}"));
        }
        match &mut self.grammar {
            Some(matcher) => matcher
                .consume_token(token)
                .map_err(|e| format!("constrained decoding failed: {e}")),
            None => Ok(()),
        }
    }

    fn is_finished(&self) -> bool {
        self.grammar.as_ref().is_some_and(Matcher::is_stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_tokenizer() -> Tokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
        Tokenizer::from_dir(&dir).expect("demo tokenizer loads")
    }

    /// Drives a processor greedily over uniform logits (always the lowest allowed id),
    /// returning the ids.
    fn drive(mut processor: Box<dyn LogitsProcessor>, vocab: usize, max: usize) -> Vec<TokenId> {
        let mut out = Vec::new();
        for _ in 0..max {
            if processor.is_finished() {
                break;
            }
            let mut logits = vec![0.0f32; vocab];
            // Prefer closing tokens so the walk terminates: a slight bias to `}` and `"`.
            processor.mask(&mut logits);
            let id = logits
                .iter()
                .position(|l| l.is_finite())
                .expect("some token allowed") as TokenId;
            processor.accept(id).expect("allowed token accepted");
            out.push(id);
        }
        out
    }

    #[test]
    fn tool_call_grammar_produces_a_parsable_call() {
        let tok = demo_tokenizer();
        let constraints = Constraints::new(&tok, 1212).expect("trie");
        assert!(constraints.has_tool_tokens());
        let schema = json!({"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                            "required": ["unit"], "additionalProperties": false});
        let matcher = constraints
            .tool_calls(&[("get_weather", &schema)], true)
            .expect("grammar compiles");
        let processor = Processor::build(&[], &[], Some(matcher)).expect("processor");
        let ids = drive(processor, 1212, 200);
        let text = tok.decode(&ids, false).expect("decodes");
        assert!(
            text.starts_with("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"unit\": \""),
            "{text}"
        );
        assert!(
            text.ends_with("\"}<|tool_call_end|><|tool_calls_section_end|>"),
            "{text}"
        );
    }

    #[test]
    fn text_tool_formats_produce_calls_their_parser_reads() {
        use crate::json_tool_parser::{JsonToolParser, ToolEvent};
        use crate::tool_format::{JsonToolFormat, JsonToolKind};
        let tok = demo_tokenizer();
        let constraints = Constraints::new(&tok, 1212).expect("trie");
        let schema = json!({"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                            "required": ["unit"], "additionalProperties": false});
        for kind in [
            JsonToolKind::Hermes,
            JsonToolKind::Llama3Json,
            JsonToolKind::Mistral,
            JsonToolKind::MistralArgs,
            JsonToolKind::Generic,
        ] {
            let format = JsonToolFormat {
                kind,
                template_renders_tools: false,
                tag_token: None,
                args_token: None,
            };
            let matcher = constraints
                .json_tool_calls(&format, &[("get_weather", &schema)], true)
                .expect("grammar compiles");
            let processor = Processor::build(&[], &[], Some(matcher)).expect("processor");
            let ids = drive(processor, 1212, 200);
            let text = tok.decode(&ids, false).expect("decodes");
            let expected = kind.write_calls(&[("get_weather".into(), "{\"unit\": \"c\"}".into())]);
            assert_eq!(text, expected, "{kind:?}");
            let mut parser = JsonToolParser::new(kind, true);
            let mut events = parser.push_text(&text);
            events.extend(parser.finish());
            assert_eq!(events.len(), 2, "{kind:?}: {events:?}");
            assert!(
                matches!(&events[0], ToolEvent::CallStart { name, .. } if name == "get_weather")
            );
            assert_eq!(
                events[1],
                ToolEvent::Arguments {
                    index: 0,
                    text: "{\"unit\": \"c\"}".into()
                }
            );
        }
    }

    #[test]
    fn a_tag_that_is_a_special_token_is_named_by_id() {
        use crate::tool_format::{JsonToolFormat, JsonToolKind};
        let tok = demo_tokenizer();
        let constraints = Constraints::new(&tok, 1212).expect("trie");
        // Any special token stands in for Mistral's `[TOOL_CALLS]`.
        let tag = tok.token_id(TOOL_CALL_BEGIN).expect("demo has the token");
        let format = JsonToolFormat {
            kind: JsonToolKind::Mistral,
            template_renders_tools: false,
            tag_token: Some(tag),
            args_token: None,
        };
        let schema = json!({"type": "object", "properties": {}, "additionalProperties": false});
        let matcher = constraints
            .json_tool_calls(&format, &[("f", &schema)], true)
            .expect("grammar compiles");
        let processor = Processor::build(&[], &[], Some(matcher)).expect("processor");
        let ids = drive(processor, 1212, 100);
        assert_eq!(ids.first(), Some(&tag));
        let rest = tok.decode(&ids[1..], false).expect("decodes");
        assert_eq!(rest, "[{\"name\": \"f\", \"arguments\": {}}]");
    }

    #[test]
    fn bad_schemas_are_rejected() {
        let tok = demo_tokenizer();
        let constraints = Constraints::new(&tok, 1212).expect("trie");
        assert!(constraints
            .json(Some(&json!({"type": "nonsense"})))
            .is_err());
        assert!(constraints.json(Some(&json!([1]))).is_err());
        assert!(constraints.json(Some(&json!({"type": "object"}))).is_ok());
    }

    #[test]
    fn bias_and_bans_apply() {
        let mut p = Processor::build(&[(1, 5.0)], &[2], None).expect("processor");
        let mut logits = vec![0.0; 4];
        p.mask(&mut logits);
        assert_eq!(logits, vec![0.0, 5.0, f32::NEG_INFINITY, 0.0]);
        assert!(!p.is_finished());
        assert!(Processor::build(&[], &[], None).is_none());
    }
}
