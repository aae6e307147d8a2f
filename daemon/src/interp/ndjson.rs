//! The interpreter's answer to `POST /execute`, one JSON object a line (E2B's code-interpreter
//! wire format), read with bounds and mapped to [`RunCodeEvent`]s. The guest is untrusted:
//! a line over [`MAX_LINE`], a cell's output over its cap, a line that is no JSON object, all
//! end as [`Malformed`] or [`TooLarge`], never as a panic.

use std::collections::HashMap;

use airlock_api::v1::{CodeError, CodeOutput, CodeResult, RunCodeEvent, run_code_event};
use serde_json::{Map, Value};

/// The longest line (a PNG of a large figure is one line).
pub const MAX_LINE: usize = 16 << 20;

/// A cell's answer, all lines together, by default.
pub const MAX_CELL_BYTES: u64 = 64 << 20;

/// Why an answer could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum NdjsonError {
    /// A line that is not what the format says.
    Malformed(String),
    /// A line or the whole answer over its cap.
    TooLarge(String),
}

impl std::fmt::Display for NdjsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(m) | Self::TooLarge(m) => f.write_str(m),
        }
    }
}

/// Cuts a byte stream into lines, within the caps.
#[derive(Debug)]
pub struct Lines {
    buf: Vec<u8>,
    max_line: usize,
    total: u64,
    max_total: u64,
}

impl Lines {
    pub fn new(max_line: usize, max_total: u64) -> Self {
        Self {
            buf: Vec::new(),
            max_line,
            total: 0,
            max_total,
        }
    }

    /// The complete lines `data` ends (without their `\n`; empty ones left out).
    pub fn push(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, NdjsonError> {
        self.total = self.total.saturating_add(data.len() as u64);
        if self.total > self.max_total {
            return Err(NdjsonError::TooLarge(format!(
                "the cell's output is over {} bytes",
                self.max_total
            )));
        }
        let mut lines = Vec::new();
        let mut rest = data;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            self.extend(&rest[..i])?;
            let line = std::mem::take(&mut self.buf);
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push(line);
            }
            rest = &rest[i + 1..];
        }
        self.extend(rest)?;
        Ok(lines)
    }

    fn extend(&mut self, part: &[u8]) -> Result<(), NdjsonError> {
        if self.buf.len() + part.len() > self.max_line {
            return Err(NdjsonError::TooLarge(format!(
                "a line of the interpreter's answer is over {} bytes",
                self.max_line
            )));
        }
        self.buf.extend_from_slice(part);
        Ok(())
    }

    /// The last line, if the answer ended without its `\n`.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let line = std::mem::take(&mut self.buf);
        (!line.iter().all(u8::is_ascii_whitespace)).then_some(line)
    }
}

/// What one line says.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// Output, a result or an error, for the client.
    Event(RunCodeEvent),
    /// The context's execution count after the cell.
    Count(u32),
    /// The cell's end.
    End,
    /// A type this daemon does not know (left out, for newer servers).
    Other,
}

/// The keys of a result and their MIME types; the values are text as the guest sent them
/// (the images and PDF base64).
pub const MIME: &[(&str, &str)] = &[
    ("text", "text/plain"),
    ("html", "text/html"),
    ("markdown", "text/markdown"),
    ("svg", "image/svg+xml"),
    ("png", "image/png"),
    ("jpeg", "image/jpeg"),
    ("pdf", "application/pdf"),
    ("latex", "text/latex"),
    ("json", "application/json"),
    ("javascript", "application/javascript"),
];

/// Parses one line.
pub fn parse(line: &[u8]) -> Result<Line, NdjsonError> {
    let value: Value = serde_json::from_slice(line)
        .map_err(|e| NdjsonError::Malformed(format!("a line is not JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(NdjsonError::Malformed("a line is not a JSON object".into()));
    };
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or_default();
    let event = match kind {
        "stdout" => run_code_event::Event::Stdout(output(&obj)),
        "stderr" => run_code_event::Event::Stderr(output(&obj)),
        "result" => run_code_event::Event::Result(result(&obj)),
        "error" => run_code_event::Event::Error(CodeError {
            name: text(obj.get("name")),
            value: text(obj.get("value")),
            traceback: text(obj.get("traceback")),
        }),
        "number_of_executions" => {
            let n = obj.get("execution_count").and_then(Value::as_u64);
            let n = n.ok_or_else(|| {
                NdjsonError::Malformed("number_of_executions without a count".into())
            })?;
            return Ok(Line::Count(u32::try_from(n).unwrap_or(u32::MAX)));
        }
        "end_of_execution" => return Ok(Line::End),
        "" => return Err(NdjsonError::Malformed("a line without a type".into())),
        _ => return Ok(Line::Other),
    };
    Ok(Line::Event(RunCodeEvent { event: Some(event) }))
}

fn output(obj: &Map<String, Value>) -> CodeOutput {
    CodeOutput {
        text: text(obj.get("text")),
        timestamp_unix_ns: obj.get("timestamp").and_then(Value::as_i64).unwrap_or(0),
    }
}

fn result(obj: &Map<String, Value>) -> CodeResult {
    let mut data = HashMap::new();
    for (key, mime) in MIME {
        if let Some(v) = obj.get(*key).filter(|v| !v.is_null()) {
            data.insert((*mime).to_owned(), text(Some(v)));
        }
    }
    let json_text = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => String::new(),
        Some(v) => v.to_string(),
    };
    CodeResult {
        data,
        is_main_result: obj
            .get("is_main_result")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        chart: json_text("chart"),
        extra: json_text("extra"),
    }
}

/// A value as text: a string as it is, a list of strings joined by lines (a traceback as
/// some servers send it), anything else as JSON text.
fn text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
        Some(v) => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lines_are_cut_anywhere_and_bounded() {
        let mut l = Lines::new(8, 100);
        assert!(l.push(b"{\"a\"").unwrap().is_empty());
        assert_eq!(
            l.push(b":1}\n\n{}\n{").unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"{}".to_vec()]
        );
        assert_eq!(l.finish(), Some(b"{".to_vec()));
        assert_eq!(l.finish(), None);
        let mut l = Lines::new(8, 100);
        assert!(matches!(
            l.push(b"123456789"),
            Err(NdjsonError::TooLarge(_))
        ));
        let mut l = Lines::new(8, 10);
        l.push(b"1234\n1234\n").unwrap();
        assert!(matches!(l.push(b"1"), Err(NdjsonError::TooLarge(_))));
    }

    #[test]
    fn every_line_type_maps_and_garbage_is_an_error() {
        let ev = |l: &str| match parse(l.as_bytes()).unwrap() {
            Line::Event(e) => e.event.unwrap(),
            other => panic!("{other:?}"),
        };
        let run_code_event::Event::Stdout(o) =
            ev(r#"{"type":"stdout","text":"hi\n","timestamp":5}"#)
        else {
            panic!()
        };
        assert_eq!((o.text.as_str(), o.timestamp_unix_ns), ("hi\n", 5));
        let r = ev(
            r#"{"type":"result","text":"1","png":"iVBO","json":{"a":[1]},"chart":{"t":"line"},"is_main_result":true,"html":null}"#,
        );
        let run_code_event::Event::Result(r) = r else {
            panic!()
        };
        assert_eq!(r.data["text/plain"], "1");
        assert_eq!(r.data["image/png"], "iVBO");
        assert_eq!(r.data["application/json"], r#"{"a":[1]}"#);
        assert!(!r.data.contains_key("text/html"));
        assert!(r.is_main_result);
        assert_eq!(r.chart, r#"{"t":"line"}"#);
        assert_eq!(r.extra, "");
        let run_code_event::Event::Error(e) = ev(
            r#"{"type":"error","name":"ZeroDivisionError","value":"division by zero","traceback":["a","b"]}"#,
        ) else {
            panic!()
        };
        assert_eq!(
            (e.name.as_str(), e.traceback.as_str()),
            ("ZeroDivisionError", "a\nb")
        );
        assert_eq!(
            parse(br#"{"type":"number_of_executions","execution_count":3}"#).unwrap(),
            Line::Count(3)
        );
        assert_eq!(parse(br#"{"type":"end_of_execution"}"#).unwrap(), Line::End);
        assert_eq!(parse(br#"{"type":"newer"}"#).unwrap(), Line::Other);
        for bad in [
            &b"{not json"[..],
            b"[1]",
            b"{}",
            b"\xff\xfe",
            br#"{"type":"number_of_executions"}"#,
        ] {
            assert!(
                matches!(parse(bad), Err(NdjsonError::Malformed(_))),
                "{bad:?}"
            );
        }
    }
}
