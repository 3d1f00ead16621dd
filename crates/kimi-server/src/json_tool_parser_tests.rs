use super::*;

/// The content and calls (name, arguments) of `pieces` fed one after another, and the
/// argument chunks of each call as they arrived.
#[derive(Debug, Default, PartialEq)]
struct Parsed {
    content: String,
    calls: Vec<(String, String)>,
    chunks: Vec<Vec<String>>,
}

fn parse(kind: JsonToolKind, pieces: &[&str]) -> Parsed {
    let mut parser = JsonToolParser::new(kind, true);
    let mut parsed = Parsed::default();
    let mut events: Vec<ToolEvent> = Vec::new();
    for piece in pieces {
        events.extend(parser.push_text(piece));
    }
    events.extend(parser.finish());
    for event in events {
        match event {
            ToolEvent::Content(text) => parsed.content += &text,
            ToolEvent::CallStart { index, id, name } => {
                assert_eq!(index, parsed.calls.len());
                assert!(id.starts_with("call_"), "{id}");
                parsed.calls.push((name, String::new()));
                parsed.chunks.push(Vec::new());
            }
            ToolEvent::Arguments { index, text } => {
                parsed.calls[index].1 += &text;
                parsed.chunks[index].push(text);
            }
        }
    }
    assert_eq!(parser.num_calls(), parsed.calls.len());
    parsed
}

/// `text` split into pieces of `n` characters (as tokens might split it).
fn split(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(n).map(|c| c.iter().collect()).collect()
}

fn parse_split(kind: JsonToolKind, text: &str, n: usize) -> Parsed {
    let pieces = split(text, n);
    let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
    parse(kind, &refs)
}

fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, a)| (n.to_string(), a.to_string()))
        .collect()
}

#[test]
fn hermes_calls_after_content_at_every_split() {
    let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \
                \"arguments\": {}}\n</tool_call>\n";
    for n in [1, 2, 3, 5, 7, 11, 1000] {
        let parsed = parse_split(JsonToolKind::Hermes, text, n);
        assert_eq!(parsed.content, "Let me check.", "split {n}");
        assert_eq!(
            parsed.calls,
            calls(&[("get_weather", "{\"city\": \"Paris\"}"), ("get_time", "{}")]),
            "split {n}"
        );
    }
}

#[test]
fn arguments_stream_in_chunks_as_they_arrive() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"xyz\"}}</tool_call>";
    let parsed = parse_split(JsonToolKind::Hermes, text, 4);
    assert_eq!(parsed.calls, calls(&[("f", "{\"a\": \"xyz\"}")]));
    assert!(parsed.chunks[0].len() > 2, "{:?}", parsed.chunks);
    assert_eq!(parsed.content, "");
}

#[test]
fn hermes_text_that_only_looks_like_a_tag_is_content() {
    let parsed = parse(JsonToolKind::Hermes, &["a <tool", "_c", "x> b <tool_ca"]);
    assert_eq!(parsed.content, "a <tool_cx> b <tool_ca");
    assert!(parsed.calls.is_empty());
    let parsed = parse(
        JsonToolKind::Hermes,
        &["<tool_call>not json</tool_call> ok"],
    );
    assert_eq!(parsed.content, "<tool_call>not json</tool_call> ok");
    assert!(parsed.calls.is_empty());
}

#[test]
fn llama3_json_calls_and_answers() {
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Tokyo\"}}; \
                {\"name\": \"get_time\", \"parameters\": {\"tz\": \"JST\"}}";
    for n in [1, 3, 1000] {
        let parsed = parse_split(JsonToolKind::Llama3Json, text, n);
        assert_eq!(
            parsed.calls,
            calls(&[
                ("get_weather", "{\"city\": \"Tokyo\"}"),
                ("get_time", "{\"tz\": \"JST\"}")
            ])
        );
        assert_eq!(parsed.content, "");
    }
    let parsed = parse(
        JsonToolKind::Llama3Json,
        &["<|python_tag|>", "{\"name\": \"f\", \"parameters\": {}}"],
    );
    assert_eq!(parsed.calls, calls(&[("f", "{}")]));
    // JSON that is not a call, and a call after text, are content.
    for text in [
        "  {\"answer\": 42}",
        "Sure: {\"name\": \"f\", \"parameters\": {}}",
    ] {
        let parsed = parse_split(JsonToolKind::Llama3Json, text, 2);
        assert_eq!(parsed.content, text);
        assert!(parsed.calls.is_empty());
    }
}

#[test]
fn mistral_call_lists() {
    let text = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, \
                {\"name\": \"b\", \"arguments\": {\"y\": \"]\"}}]";
    for n in [1, 4, 1000] {
        let parsed = parse_split(JsonToolKind::Mistral, text, n);
        assert_eq!(
            parsed.calls,
            calls(&[("a", "{\"x\": [1, 2]}"), ("b", "{\"y\": \"]\"}")])
        );
        assert_eq!(parsed.content, "");
    }
    let parsed = parse(JsonToolKind::Mistral, &["Hello [TOOL", "S] there"]);
    assert_eq!(parsed.content, "Hello [TOOLS] there");
}

#[test]
fn generic_envelope_and_plain_json() {
    let text = "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \
                \"Paris\", \"days\": 3}}, {\"arguments\": {\"q\": \"x\"}, \"name\": \"search\"}]}";
    for n in [1, 2, 5, 1000] {
        let parsed = parse_split(JsonToolKind::Generic, text, n);
        assert_eq!(
            parsed.calls,
            calls(&[
                ("get_weather", "{\"city\": \"Paris\", \"days\": 3}"),
                ("search", "{\"q\": \"x\"}")
            ])
        );
        assert_eq!(parsed.content, "");
    }
    for text in [
        "{\"city\": \"Paris\"}",
        "Hello {\"tool_calls\": []}",
        "{\"tool_calls\": 3}",
    ] {
        let parsed = parse_split(JsonToolKind::Generic, text, 3);
        assert_eq!(parsed.content, text);
        assert!(parsed.calls.is_empty());
    }
}

#[test]
fn a_call_cut_short_keeps_what_it_has() {
    let parsed = parse(
        JsonToolKind::Generic,
        &["{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1"],
    );
    assert_eq!(parsed.calls, calls(&[("f", "{\"a\": 1")]));
    // Cut before the name: nothing was a call yet, so the text is content.
    let parsed = parse(JsonToolKind::Hermes, &["<tool_call>{\"na"]);
    assert_eq!(parsed.content, "<tool_call>{\"na");
    assert!(parsed.calls.is_empty());
}

#[test]
fn tokens_that_split_characters_and_tags_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
    let tok = Tokenizer::from_dir(&dir).expect("demo tokenizer");
    let text = "ok<tool_call>{\"name\": \"f\", \"arguments\": {\"k\": \"é\"}}</tool_call>";
    let ids = tok.encode(text, false).expect("encodes");
    let mut parser = JsonToolParser::new(JsonToolKind::Hermes, true);
    let mut events = Vec::new();
    for id in ids {
        events.extend(parser.push_token(&tok, id));
    }
    events.extend(parser.finish());
    let arguments: String = events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Arguments { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(arguments, "{\"k\": \"é\"}");
    let content: String = events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Content(text) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(content, "ok");
}

#[test]
fn mistral_calls_named_before_args() {
    let text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Pa}ris\", \"n\": [1]}\
                [TOOL_CALLS]get_time[ARGS]{}";
    for n in [1, 3, 1000] {
        let parsed = parse_split(JsonToolKind::Mistral, text, n);
        assert_eq!(
            parsed.calls,
            calls(&[
                ("get_weather", "{\"city\": \"Pa}ris\", \"n\": [1]}"),
                ("get_time", "{}")
            ]),
            "split {n}"
        );
        assert_eq!(parsed.content, "");
    }
    let parsed = parse(JsonToolKind::Mistral, &["[TOOL_CALLS]not a name"]);
    assert_eq!(parsed.content, "[TOOL_CALLS]not a name");
    assert!(parsed.calls.is_empty());
}
