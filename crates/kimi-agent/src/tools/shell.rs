//! Shell tools: an allowlisted program with arguments from a template, run in the sandbox.
//! No shell parses anything: each template element becomes argv elements directly.

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::{scalar_text, CallContext, ToolOutput};
use crate::config::{SandboxConfig, ShellToolConfig};
use crate::sandbox::{Limits, Sandbox};

/// One element of the argument template.
#[derive(Debug, Clone, PartialEq)]
enum Element {
    /// Passed as is.
    Literal(String),
    /// Exactly `{name}`: one argv element per value (arrays give several), none when absent.
    Whole(String),
    /// Text around placeholders: one argv element, dropped when any argument is absent.
    Mixed(Vec<Piece>),
}

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Arg(String),
}

/// A configured shell tool.
#[derive(Debug)]
pub struct ShellTool {
    program: PathBuf,
    template: Vec<Element>,
    allow_option_values: bool,
    limits: Limits,
}

impl ShellTool {
    /// Checks the program against the allowlist and every placeholder against `schema`.
    ///
    /// # Errors
    ///
    /// A program outside the allowlist, a placeholder in the program's place, a malformed
    /// placeholder or one the schema does not declare, or a bad limit.
    pub fn new(
        c: &ShellToolConfig,
        sandbox_config: &SandboxConfig,
        sandbox: &Sandbox,
        schema: &Value,
    ) -> Result<ShellTool, String> {
        let Some((program, rest)) = c.command.split_first() else {
            return Err("`command` is empty".into());
        };
        if program.contains('{') {
            return Err("the program (`command[0]`) cannot be a placeholder".into());
        }
        let program = sandbox
            .allowlist()
            .resolve(program)
            .ok_or_else(|| {
                format!(
                    "runs `{program}`, which is not in [sandbox] programs ({})",
                    sandbox.allowlist().names().join(", ")
                )
            })?
            .to_owned();
        let template = rest
            .iter()
            .map(|e| parse_element(e))
            .collect::<Result<Vec<_>, _>>()?;
        let declared = schema.get("properties").and_then(Value::as_object);
        for name in template.iter().flat_map(placeholders) {
            if !declared.is_some_and(|p| p.contains_key(name)) {
                return Err(format!(
                    "the placeholder `{{{name}}}` is not a property of `parameters`"
                ));
            }
        }
        Ok(ShellTool {
            program,
            template,
            allow_option_values: c.allow_option_values,
            limits: Limits::new(sandbox_config, &c.sandbox)?,
        })
    }

    /// Runs the program with `args` filled in.
    pub async fn call(
        &self,
        args: &Map<String, Value>,
        sandbox: &Sandbox,
        ctx: &CallContext,
    ) -> ToolOutput {
        let argv = match render(&self.template, args, self.allow_option_values) {
            Ok(argv) => argv,
            Err(e) => return ToolOutput::error(e),
        };
        let workdir = sandbox.workdir.as_deref().unwrap_or(&ctx.workdir);
        let outcome = sandbox
            .run(&self.program, &argv, workdir, &self.limits)
            .await;
        let text = outcome.describe(&self.limits);
        if outcome.success() {
            ToolOutput::ok(text)
        } else {
            ToolOutput::error(text)
        }
    }
}

fn placeholders(e: &Element) -> Vec<&str> {
    match e {
        Element::Literal(_) => Vec::new(),
        Element::Whole(n) => vec![n.as_str()],
        Element::Mixed(pieces) => pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Arg(n) => Some(n.as_str()),
                Piece::Text(_) => None,
            })
            .collect(),
    }
}

/// Parses `{name}` placeholders; `{{` and `}}` are literal braces.
fn parse_element(text: &str) -> Result<Element, String> {
    let mut pieces = Vec::new();
    let mut literal = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                literal.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                literal.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_alphanumeric() || c == '_' || c == '-' => {
                            name.push(c)
                        }
                        _ => {
                            return Err(format!(
                                "`{text}`: a placeholder is `{{name}}` with a name of letters, \
                                 digits, `_` or `-` (write `{{{{` for a literal brace)"
                            ))
                        }
                    }
                }
                if name.is_empty() {
                    return Err(format!("`{text}`: an empty placeholder `{{}}`"));
                }
                if !literal.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut literal)));
                }
                pieces.push(Piece::Arg(name));
            }
            '}' => return Err(format!("`{text}`: a `}}` without its `{{` (write `}}}}`)")),
            c => literal.push(c),
        }
    }
    if !literal.is_empty() {
        pieces.push(Piece::Text(literal));
    }
    Ok(match pieces.as_slice() {
        [] => Element::Literal(String::new()),
        [Piece::Text(t)] => Element::Literal(t.clone()),
        [Piece::Arg(n)] => Element::Whole(n.clone()),
        _ => Element::Mixed(pieces),
    })
}

/// The argv after the program for `args`.
fn render(
    template: &[Element],
    args: &Map<String, Value>,
    allow_option_values: bool,
) -> Result<Vec<String>, String> {
    let mut argv = Vec::new();
    let checked = |name: &str, text: String, whole: bool| -> Result<String, String> {
        if text.contains('\0') {
            return Err(format!("the argument `{name}` contains a NUL character"));
        }
        if whole && !allow_option_values && text.starts_with('-') {
            return Err(format!(
                "the argument `{name}` starts with `-`, which the program would read as an \
                 option; this tool does not accept such values"
            ));
        }
        Ok(text)
    };
    for element in template {
        match element {
            Element::Literal(text) => argv.push(text.clone()),
            Element::Whole(name) => match args.get(name) {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for item in items {
                        let text = scalar_text(item).ok_or_else(|| {
                            format!("the argument `{name}` must be a list of strings or numbers")
                        })?;
                        argv.push(checked(name, text, true)?);
                    }
                }
                Some(value) => {
                    let text = scalar_text(value).ok_or_else(|| {
                        format!("the argument `{name}` must be a string, number or boolean")
                    })?;
                    argv.push(checked(name, text, true)?);
                }
            },
            Element::Mixed(pieces) => {
                let mut text = String::new();
                let mut complete = true;
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => text.push_str(t),
                        Piece::Arg(name) => match args.get(name) {
                            None | Some(Value::Null) => complete = false,
                            Some(value) => {
                                let part = scalar_text(value).ok_or_else(|| {
                                    format!(
                                        "the argument `{name}` must be a string, number or \
                                         boolean"
                                    )
                                })?;
                                text.push_str(&checked(name, part, false)?);
                            }
                        },
                    }
                }
                if complete {
                    argv.push(text);
                }
            }
        }
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(parts: &[&str]) -> Vec<Element> {
        parts.iter().map(|p| parse_element(p).unwrap()).collect()
    }

    #[test]
    fn placeholders_become_argv_elements() {
        let t = template(&["-n", "{pattern}", "--max-count={n}", "--", "{files}"]);
        let args = json!({"pattern": "a b; rm -rf /", "n": 3, "files": ["x y", "z"]});
        let argv = render(&t, args.as_object().unwrap(), false).unwrap();
        assert_eq!(
            argv,
            ["-n", "a b; rm -rf /", "--max-count=3", "--", "x y", "z"]
        );
        // Optional arguments drop their elements.
        let argv = render(&t, json!({"pattern": "p"}).as_object().unwrap(), false).unwrap();
        assert_eq!(argv, ["-n", "p", "--"]);
    }

    #[test]
    fn option_like_values_and_bad_templates_are_refused() {
        let t = template(&["{path}"]);
        let err = render(&t, json!({"path": "--help"}).as_object().unwrap(), false).unwrap_err();
        assert!(err.contains("starts with `-`"), "{err}");
        assert!(render(&t, json!({"path": "--help"}).as_object().unwrap(), true).is_ok());
        assert!(render(&t, json!({"path": {"a": 1}}).as_object().unwrap(), true).is_err());
        assert!(render(&t, json!({"path": "a\u{0}b"}).as_object().unwrap(), true).is_err());
        assert!(parse_element("{a").is_err());
        assert!(parse_element("a}").is_err());
        assert!(parse_element("{}").is_err());
        assert!(parse_element("{a b}").is_err());
        assert_eq!(
            parse_element("{{x}}").unwrap(),
            Element::Literal("{x}".into())
        );
    }
}
