//! The parser fed token by token (K3 demo tokenizer, markers as control tokens) and as text
//! in every chunk size, for each known failure of spec §5.

use serde_json::{json, Value};

use super::*;

fn k3_tokenizer() -> Tokenizer {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer-k3");
    Tokenizer::from_dir(&dir).expect("K3 demo tokenizer loads")
}

/// What a client would assemble.
#[derive(Debug, Default, PartialEq)]
struct Output {
    reasoning: String,
    content: String,
    /// `(name, arguments)`.
    calls: Vec<(String, String)>,
}

fn out(reasoning: &str, content: &str, calls: &[(&str, &str)]) -> Output {
    Output {
        reasoning: reasoning.into(),
        content: content.into(),
        calls: calls
            .iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect(),
    }
}

fn apply(events: Vec<XtmlEvent>, out: &mut Output, ids: &mut Vec<String>) {
    for event in events {
        match event {
            XtmlEvent::Reasoning(t) => out.reasoning += &t,
            XtmlEvent::Content(t) => out.content += &t,
            XtmlEvent::CallStart { index, id, name } => {
                assert_eq!(index, out.calls.len(), "indices count from 0");
                assert!(id.starts_with("call_") && !ids.contains(&id), "{id}");
                ids.push(id);
                out.calls.push((name, String::new()));
            }
            XtmlEvent::Arguments { index, text } => out.calls[index].1 += &text,
        }
    }
}

fn parser(tok: &Tokenizer, start: XtmlStart, tools: bool) -> XtmlParser {
    XtmlParser::new(
        XtmlTokens::find(tok).expect("K3 markers"),
        start,
        tools,
        true,
    )
}

fn by_tokens(tok: &Tokenizer, text: &str, start: XtmlStart, tools: bool) -> Output {
    let mut p = parser(tok, start, tools);
    let (mut got, mut ids) = (Output::default(), Vec::new());
    for id in tok.encode(text, true).expect("encodes") {
        apply(p.push_token(tok, id), &mut got, &mut ids);
    }
    apply(p.finish(), &mut got, &mut ids);
    assert_eq!(p.num_calls(), got.calls.len());
    got
}

fn by_chunks(tok: &Tokenizer, text: &str, start: XtmlStart, tools: bool, size: usize) -> Output {
    let mut p = parser(tok, start, tools);
    let (mut got, mut ids) = (Output::default(), Vec::new());
    let chars: Vec<char> = text.chars().collect();
    for chunk in chars.chunks(size) {
        apply(
            p.push_text(&chunk.iter().collect::<String>()),
            &mut got,
            &mut ids,
        );
    }
    apply(p.finish(), &mut got, &mut ids);
    got
}

/// Every way of feeding `text` gives `want`, and every call's arguments are a JSON object.
fn check_with(text: &str, start: XtmlStart, tools: bool, want: &Output) {
    let tok = k3_tokenizer();
    assert_eq!(&by_tokens(&tok, text, start, tools), want, "token by token");
    for size in [1, 2, 3, 5, 7, 11, 64, text.len().max(1)] {
        assert_eq!(
            &by_chunks(&tok, text, start, tools, size),
            want,
            "chunks of {size}"
        );
    }
    for (_, arguments) in &want.calls {
        let parsed: Value = serde_json::from_str(arguments).expect("arguments are JSON");
        assert!(parsed.is_object(), "{arguments}");
    }
    assert!(!want.content.contains("<|") && !want.reasoning.contains("<|"));
}

fn check(text: &str, start: XtmlStart, want: Output) {
    check_with(text, start, true, &want);
}

const CALL: &str = "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
    <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris \"16e\"\n<|close|>argument<|sep|>\
    <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
    <|close|>call<|sep|><|close|>tools<|sep|>";
const CALL_ARGS: &str = r#"{"city":"Paris \"16e\"\n","days":3}"#;

#[test]
fn a_whole_message_with_thinking() {
    let text = format!(
        "Let me check.<|close|>think<|sep|><|open|>response<|sep|>Checking…<|close|>response\
         <|sep|>{CALL}<|close|>message<|sep|><|end_of_msg|>ignored"
    );
    check(
        &text,
        XtmlStart::Think,
        out("Let me check.", "Checking…", &[("get_weather", CALL_ARGS)]),
    );
}

#[test]
fn every_argument_type_and_parallel_calls() {
    let text = "<|close|>response<|sep|><|open|>tools<|sep|>\
        <|open|>call tool=\"f\" index=\"1\"<|sep|>\
        <|open|>argument key=\"s\" type=\"string\"<|sep|>a\\b<|close|>argument<|sep|>\
        <|open|>argument key=\"n\" type=\"number\"<|sep|> -1.50e3 <|close|>argument<|sep|>\
        <|open|>argument key=\"b\" type=\"boolean\"<|sep|>false<|close|>argument<|sep|>\
        <|open|>argument key=\"z\" type=\"null\"<|sep|>null<|close|>argument<|sep|>\
        <|open|>argument key=\"o\" type=\"object\"<|sep|>{\"tags\": [\"a\", \"b\"], \"max\": 3}<|close|>argument<|sep|>\
        <|open|>argument key=\"a\" type=\"array\"<|sep|>[1, 2]<|close|>argument<|sep|>\
        <|open|>argument key=\"q&quot;k\" type=\"string\"<|sep|><|close|>argument<|sep|>\
        <|close|>call<|sep|>\
        <|open|>call tool=\"g\" index=\"2\"<|sep|><|close|>call<|sep|>\
        <|open|>call tool=\"h\" index=\"3\"<|sep|><|open|>json type=\"object\"<|sep|>{\"x\": [1]}<|close|>json<|sep|><|close|>call<|sep|>\
        <|close|>tools<|sep|><|close|>message<|sep|>";
    let want = out(
        "",
        "",
        &[
            (
                "f",
                r#"{"s":"a\\b","n":-1.50e3,"b":false,"z":null,"o":{"tags": ["a", "b"], "max": 3},"a":[1, 2],"q\"k":""}"#,
            ),
            ("g", "{}"),
            ("h", r#"{"x": [1]}"#),
        ],
    );
    check(text, XtmlStart::Response, want);
    let args: Value = serde_json::from_str(
        &by_tokens(&k3_tokenizer(), text, XtmlStart::Response, true).calls[0].1,
    )
    .expect("JSON");
    assert_eq!(args["o"], json!({"tags": ["a", "b"], "max": 3}));
    assert_eq!(args["n"], json!(-1500.0));
}

#[test]
fn missing_think_close_still_yields_calls() {
    // vLLM #53246: the model goes from reasoning straight to the tools section.
    check(
        &format!("I need the weather.{CALL}<|close|>message<|sep|>"),
        XtmlStart::Think,
        out("I need the weather.", "", &[("get_weather", CALL_ARGS)]),
    );
    // ... or straight to the response.
    check(
        "hmm<|open|>response<|sep|>Hi!<|close|>response<|sep|>",
        XtmlStart::Think,
        out("hmm", "Hi!", &[]),
    );
}

#[test]
fn calls_without_native_markers_stay_content() {
    // sglang #34604: no JSON-array fallback turning prose into calls or errors.
    for prose in [
        r#"[{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
        r#"functions.get_weather:0 {"city": "Paris"}"#,
        "I would call get_weather(city=\"Paris\") here.",
    ] {
        check(prose, XtmlStart::Response, out("", prose, &[]));
        check(
            &format!("{prose}<|close|>response<|sep|><|close|>message<|sep|>"),
            XtmlStart::Response,
            out("", prose, &[]),
        );
    }
}

#[test]
fn max_tokens_cuts_after_a_control_token() {
    let r = XtmlStart::Response;
    check("answer<|close|>", r, out("", "answer", &[]));
    // vLLM #57353: reasoning cut short is still reasoning.
    check(
        "cut mid-thought",
        XtmlStart::Think,
        out("cut mid-thought", "", &[]),
    );
    check("answer<|close|>respo", r, out("", "answer", &[]));
    check("answer<|clo", r, out("", "answer", &[]));
    check("a < b", r, out("", "a < b", &[]));
    check("ends with <", r, out("", "ends with <", &[]));
    check(
        "think<|close|>think<|sep|><|open|>",
        XtmlStart::Think,
        out("think", "", &[]),
    );
    // A call header cut before `<|sep|>` starts no call.
    check(
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_w",
        r,
        out("", "", &[]),
    );
    // A call cut inside an argument still closes its object.
    let cut = "<|close|>response<|sep|><|open|>tools<|sep|>\
        <|open|>call tool=\"f\" index=\"1\"<|sep|>\
        <|open|>argument key=\"n\" type=\"number\"<|sep|>4<|close|>argument<|sep|>\
        <|open|>argument key=\"city\" type=\"string\"<|sep|>Par";
    check(cut, r, out("", "", &[("f", r#"{"n":4,"city":"Par"}"#)]));
    check(
        &(cut.replace("Par", "").replace("string", "array") + "[1, 2"),
        r,
        out("", "", &[("f", r#"{"n":4,"city":"[1, 2"}"#)]),
    );
}

#[test]
fn malformed_argument_types_fall_back_to_strings() {
    let text =
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>\
        <|open|>argument key=\"n\" type=\"number\"<|sep|>about 3<|close|>argument<|sep|>\
        <|open|>argument key=\"w\" type=\"weird\"<|sep|>{\"ok\": 1}<|close|>argument<|sep|>\
        <|open|>argument key=\"u\"<|sep|>untyped<|close|>argument<|sep|>\
        <|open|>argument key=\"e\" type=\"object\"<|sep|><|close|>argument<|sep|>\
        <|close|>call<|sep|><|close|>tools<|sep|>";
    check(
        text,
        XtmlStart::Response,
        out(
            "",
            "",
            &[("f", r#"{"n":"about 3","w":{"ok": 1},"u":"untyped","e":""}"#)],
        ),
    );
}

#[test]
fn unexpected_call_shapes_are_read() {
    // Attributes in another order, `name=` for `tool=`, no tools wrapper, payloads that are
    // not objects, and a call with no name (skipped).
    let text = "<|close|>response<|sep|><|open|>call index=\"1\" name=\"f\"<|sep|>\
        <|open|>json type=\"object\"<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|>\
        <|open|>call tool=\"g\"<|sep|><|open|>json type=\"object\"<|sep|>{\"a\": <|close|>json<|sep|>\
        <|close|>call<|sep|><|open|>call index=\"3\"<|sep|><|open|>argument key=\"x\"<|sep|>1\
        <|close|>argument<|sep|><|close|>call<|sep|>";
    check(
        text,
        XtmlStart::Response,
        out("", "", &[("f", "{}"), ("g", "{}")]),
    );
}

#[test]
fn generation_ends_at_end_of_msg() {
    check(
        "Hi.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>\
         <|open|>message role=\"user\"<|sep|>more",
        XtmlStart::Response,
        out("", "Hi.", &[]),
    );
    check(
        "Hi.<|end_of_msg|>trailing",
        XtmlStart::Response,
        out("", "Hi.", &[]),
    );
}

#[test]
fn bare_text_and_stray_elements() {
    // No generation prompt: the model writes the assistant header itself; whitespace between
    // elements is dropped, bare text outside them is content; unknown elements keep content.
    check(
        "<|open|>message role=\"assistant\"<|sep|>\n<|open|>think<|sep|>r<|close|>think<|sep|>\n\
         bare <|open|>cite<|sep|>text<|close|>cite<|sep|> end",
        XtmlStart::Message,
        out("r", "bare text end", &[]),
    );
    // A header that never ends is given back as text.
    let long = "x".repeat(MAX_HEADER_BYTES + 10);
    let got = by_tokens(
        &k3_tokenizer(),
        &format!("a<|open|>{long}"),
        XtmlStart::Response,
        true,
    );
    assert_eq!(got.content, format!("a{long}"));
}

#[test]
fn tools_are_dropped_when_not_parsed() {
    check_with(
        &format!("Sure.<|close|>response<|sep|>{CALL}<|close|>message<|sep|>"),
        XtmlStart::Response,
        false,
        &out("", "Sure.", &[]),
    );
}

#[test]
fn literal_marker_text_in_ordinary_tokens_is_structure_too() {
    // The model spelling `<|close|>` in plain tokens still closes; nothing leaks.
    let tok = k3_tokenizer();
    let mut p = parser(&tok, XtmlStart::Think, true);
    let (mut got, mut ids) = (Output::default(), Vec::new());
    let mut feed = |text: &str, special: bool, p: &mut XtmlParser| {
        for id in tok.encode(text, special).expect("encodes") {
            apply(p.push_token(&tok, id), &mut got, &mut ids);
        }
    };
    feed("why", false, &mut p);
    feed("<|close|>think", false, &mut p);
    feed("<|sep|>", true, &mut p);
    feed("<|open|>response<|sep|>ok", true, &mut p);
    apply(p.finish(), &mut got, &mut ids);
    assert_eq!(got, out("why", "ok", &[]));
}
