//! Redaction of secret values: every value, and its base64 (standard and URL-safe, padded or
//! not, and inside a longer encoded input at any offset), hex (either case), URL-encoded and
//! JSON-escaped forms, replaced by `[REDACTED:name]` — in a whole
//! text ([`Patterns::redact`]) and in a stream cut into writes anywhere ([`StreamRedactor`],
//! which holds back only a tail that could begin a value).

use std::borrow::Cow;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine;

/// The forms of a set of named values, and a matcher over them.
#[derive(Debug)]
pub struct Patterns {
    matcher: Option<AhoCorasick>,
    /// The replacement of each pattern, by pattern index.
    replacement: Vec<Arc<[u8]>>,
    forms: Vec<Vec<u8>>,
    /// The longest form's length.
    max_len: usize,
    /// Which bytes begin a form.
    first: [bool; 256],
}

/// The encodings a value is also redacted in.
pub fn forms_of(value: &[u8]) -> Vec<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let hex_lower: String = value.iter().map(|b| format!("{b:02x}")).collect();
    let mut forms = vec![
        value.to_vec(),
        STANDARD.encode(value).into_bytes(),
        STANDARD_NO_PAD.encode(value).into_bytes(),
        URL_SAFE.encode(value).into_bytes(),
        URL_SAFE_NO_PAD.encode(value).into_bytes(),
        hex_lower.to_ascii_uppercase().into_bytes(),
        hex_lower.into_bytes(),
        url_encoded(value, false),
        url_encoded(value, true),
    ];
    for engine in [STANDARD_NO_PAD, URL_SAFE_NO_PAD] {
        forms.extend((0..3).filter_map(|offset| base64_inside(&engine, value, offset)));
    }
    if let Ok(text) = std::str::from_utf8(value) {
        forms.extend(json_escaped(text));
    }
    forms.sort();
    forms.dedup();
    forms
}

/// The base64 characters that only `value`'s bits make when it is encoded `offset` (0 to 2)
/// bytes into a longer input (`user:value` in an `Authorization: Basic` header): the
/// characters at either end that mix its bits with its neighbours' are left out. `None` when
/// too few remain to stand for the value alone.
fn base64_inside(
    engine: &base64::engine::GeneralPurpose,
    value: &[u8],
    offset: usize,
) -> Option<Vec<u8>> {
    let mut padded = vec![0u8; offset];
    padded.extend_from_slice(value);
    let encoded = engine.encode(&padded).into_bytes();
    // Character i holds bits 6i..6i+6; the value's are 8*offset..8*(offset+len).
    let first = (8 * offset).div_ceil(6);
    let end = (8 * (offset + value.len())) / 6;
    let core = encoded.get(first..end)?;
    (core.len() >= 8).then(|| core.to_vec())
}

/// `text` as JSON strings carry it: escaped as serde_json and `JSON.stringify` do (quote,
/// backslash, controls), everything past ASCII as `\uXXXX` too (Python's `json.dumps`), and
/// that with `/` as `\/` (PHP's `json_encode`).
fn json_escaped(text: &str) -> Vec<Vec<u8>> {
    let mut plain = String::new();
    let mut ascii = String::new();
    for c in text.chars() {
        let escaped = match c {
            '"' => "\\\"".to_owned(),
            '\\' => "\\\\".to_owned(),
            '\n' => "\\n".to_owned(),
            '\r' => "\\r".to_owned(),
            '\t' => "\\t".to_owned(),
            '\u{8}' => "\\b".to_owned(),
            '\u{c}' => "\\f".to_owned(),
            c if u32::from(c) < 0x20 => format!("\\u{:04x}", u32::from(c)),
            c => c.to_string(),
        };
        plain.push_str(&escaped);
        if c.is_ascii() {
            ascii.push_str(&escaped);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                ascii.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    let slashes = ascii.replace('/', "\\/");
    vec![plain.into_bytes(), ascii.into_bytes(), slashes.into_bytes()]
}

/// Percent-encoding of everything but RFC 3986's unreserved characters (`plus_space`: a space
/// as `+`, as forms encode it).
fn url_encoded(value: &[u8], plus_space: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() * 3);
    for &b in value {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => out.push(b),
            b' ' if plus_space => out.push(b'+'),
            _ => out.extend_from_slice(format!("%{b:02X}").as_bytes()),
        }
    }
    out
}

impl Default for Patterns {
    fn default() -> Self {
        Self::new([])
    }
}

impl Patterns {
    /// The patterns of `secrets` (name, value).
    pub fn new<'a>(secrets: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let mut forms = Vec::new();
        let mut replacement = Vec::new();
        for (name, value) in secrets {
            let r: Arc<[u8]> = Arc::from(format!("[REDACTED:{name}]").into_bytes());
            for f in forms_of(value) {
                if !f.is_empty() {
                    forms.push(f);
                    replacement.push(r.clone());
                }
            }
        }
        let matcher = if forms.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&forms)
                .ok()
        };
        let mut first = [false; 256];
        for f in &forms {
            if let Some(&b) = f.first() {
                first[usize::from(b)] = true;
            }
        }
        Self {
            matcher,
            replacement,
            max_len: forms.iter().map(Vec::len).max().unwrap_or(0),
            forms,
            first,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.matcher.is_none()
    }

    /// `data` with every form replaced.
    pub fn redact<'d>(&self, data: &'d [u8]) -> Cow<'d, [u8]> {
        let Some(m) = &self.matcher else {
            return Cow::Borrowed(data);
        };
        let mut out: Option<Vec<u8>> = None;
        let mut at = 0;
        for hit in m.find_iter(data) {
            let o = out.get_or_insert_with(|| Vec::with_capacity(data.len()));
            o.extend_from_slice(data.get(at..hit.start()).unwrap_or_default());
            if let Some(r) = self.replacement.get(hit.pattern().as_usize()) {
                o.extend_from_slice(r);
            }
            at = hit.end();
        }
        match out {
            None => Cow::Borrowed(data),
            Some(mut o) => {
                o.extend_from_slice(data.get(at..).unwrap_or_default());
                Cow::Owned(o)
            }
        }
    }

    /// `text` redacted (a form cut by a UTF-8 boundary cannot occur: forms are whole values).
    pub fn redact_str<'d>(&self, text: &'d str) -> Cow<'d, str> {
        match self.redact(text.as_bytes()) {
            Cow::Borrowed(_) => Cow::Borrowed(text),
            Cow::Owned(o) => Cow::Owned(String::from_utf8_lossy(&o).into_owned()),
        }
    }

    /// Where the longest suffix of `data` that is a proper prefix of a form begins (the
    /// length of `data` when none is).
    fn open_tail(&self, data: &[u8]) -> usize {
        let from = data.len().saturating_sub(self.max_len.saturating_sub(1));
        for i in from..data.len() {
            let Some(&b) = data.get(i) else { break };
            if !self.first[usize::from(b)] {
                continue;
            }
            let tail = data.get(i..).unwrap_or_default();
            if self
                .forms
                .iter()
                .any(|f| f.len() > tail.len() && f.starts_with(tail))
            {
                return i;
            }
        }
        data.len()
    }
}

/// Redacts one stream cut into arbitrary writes: a form split over two writes is still
/// replaced. What could begin a form is held back (at most the longest form's length less one
/// byte) until the next write or the end.
#[derive(Debug)]
pub struct StreamRedactor {
    patterns: Arc<Patterns>,
    held: Vec<u8>,
}

impl StreamRedactor {
    pub fn new(patterns: Arc<Patterns>) -> Self {
        Self {
            patterns,
            held: Vec::new(),
        }
    }

    /// The redacted output that `data` releases.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        if self.patterns.is_empty() {
            return data.to_vec();
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(data);
        let Some(m) = &self.patterns.matcher else {
            return buf;
        };
        let mut out = Vec::with_capacity(buf.len());
        let mut at = 0;
        for hit in m.find_iter(&buf) {
            out.extend_from_slice(buf.get(at..hit.start()).unwrap_or_default());
            if let Some(r) = self.patterns.replacement.get(hit.pattern().as_usize()) {
                out.extend_from_slice(r);
            }
            at = hit.end();
        }
        let rest = buf.get(at..).unwrap_or_default();
        let keep = self.patterns.open_tail(rest);
        out.extend_from_slice(rest.get(..keep).unwrap_or_default());
        self.held = rest.get(keep..).unwrap_or_default().to_vec();
        out
    }

    /// What is still held back (the stream ended: it begins no form).
    pub fn finish(&mut self) -> Vec<u8> {
        let held = std::mem::take(&mut self.held);
        self.patterns.redact(&held).into_owned()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn patterns() -> Arc<Patterns> {
        Arc::new(Patterns::new([
            ("API_KEY", b"sk-test-abcdef123456".as_slice()),
            ("PW", b"p@ss w/rd!".as_slice()),
        ]))
    }

    fn text(b: &[u8]) -> String {
        String::from_utf8(b.to_vec()).unwrap()
    }

    #[test]
    fn every_form_is_replaced() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let p = patterns();
        let key = "sk-test-abcdef123456";
        for form in [
            key.to_owned(),
            STANDARD.encode(key),
            URL_SAFE_NO_PAD.encode("p@ss w/rd!"),
            "736b2d746573742d616263646566313233343536".to_owned(),
            "736B2D746573742D616263646566313233343536".to_owned(),
            "p%40ss%20w%2Frd%21".to_owned(),
            "p%40ss+w%2Frd%21".to_owned(),
        ] {
            let out = p.redact(format!("a {form} b").as_bytes()).into_owned();
            let out = text(&out);
            assert!(out.starts_with("a [REDACTED:"), "{form}: {out}");
            assert!(out.ends_with("] b"), "{form}: {out}");
            assert!(!out.contains(&form), "{form}: {out}");
        }
        assert_eq!(
            p.redact(b"nothing here"),
            Cow::Borrowed(b"nothing here".as_slice())
        );
    }

    #[test]
    fn base64_of_a_value_inside_other_bytes_is_replaced_at_every_offset() {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let p = patterns();
        let key = "sk-test-abcdef123456";
        // `Authorization: Basic base64(user:value)`: the value at offset 5, 2 mod 3.
        for prefix in ["", "a", "ab", "abc", "user:", "bot:x"] {
            for suffix in ["", "x", "xy", ":rest-of-it"] {
                let whole = format!("{prefix}{key}{suffix}");
                for encoded in [STANDARD.encode(&whole), URL_SAFE_NO_PAD.encode(&whole)] {
                    let out = text(&p.redact(format!("Basic {encoded}\n").as_bytes()));
                    assert!(out.contains("[REDACTED:API_KEY]"), "{whole:?}: {out}");
                    // What is left around the marker cannot carry the value: at most the
                    // two characters each side that mix its bits with its neighbours'.
                    let kept = out.len() - "Basic \n[REDACTED:API_KEY]".len();
                    assert!(kept <= encoded.len() - 24, "{whole:?}: {out}");
                }
            }
        }
    }

    #[test]
    fn json_escaped_values_are_replaced() {
        let p = Arc::new(Patterns::new([(
            "K",
            "quote\"back\\slash/\u{e9}t\u{e9}\n1234".as_bytes(),
        )]));
        for form in [
            // serde_json, JSON.stringify: quotes, backslashes and controls escaped.
            r#"quote\"back\\slash/été\n1234"#,
            // Python's json.dumps: everything past ASCII as \uXXXX too.
            r#"quote\"back\\slash/\u00e9t\u00e9\n1234"#,
            // PHP's json_encode: the slash escaped as well.
            r#"quote\"back\\slash\/\u00e9t\u00e9\n1234"#,
        ] {
            let out = text(&p.redact(format!("{{\"k\": \"{form}\"}}").as_bytes()));
            assert_eq!(out, "{\"k\": \"[REDACTED:K]\"}", "{form}");
        }
    }

    #[test]
    fn a_value_split_over_writes_is_replaced_wherever_it_is_cut() {
        let p = patterns();
        let whole = b"before sk-test-abcdef123456 after, sk-test-abcdef123456".to_vec();
        for cut in 0..=whole.len() {
            for cut2 in cut..=whole.len() {
                let mut r = StreamRedactor::new(p.clone());
                let mut out = r.push(&whole[..cut]);
                out.extend(r.push(&whole[cut..cut2]));
                out.extend(r.push(&whole[cut2..]));
                out.extend(r.finish());
                assert_eq!(
                    text(&out),
                    "before [REDACTED:API_KEY] after, [REDACTED:API_KEY]",
                    "cut at {cut}, {cut2}"
                );
            }
        }
    }

    #[test]
    fn byte_by_byte_output_is_redacted_and_only_a_possible_start_is_held() {
        let p = patterns();
        let mut r = StreamRedactor::new(p.clone());
        let mut out = Vec::new();
        for b in b"x=sk-test-abcdef123456;" {
            out.extend(r.push(&[*b]));
        }
        out.extend(r.finish());
        assert_eq!(text(&out), "x=[REDACTED:API_KEY];");
        // Output that cannot begin a form is released at once.
        let mut r = StreamRedactor::new(p);
        assert_eq!(r.push(b"hello world\n"), b"hello world\n");
        assert_eq!(r.push(b"abc sk-te"), b"abc ");
        assert_eq!(r.push(b"ll"), b"sk-tell");
        assert!(r.finish().is_empty());
    }

    #[test]
    fn the_held_tail_is_bounded_and_flushed_at_the_end() {
        let p = patterns();
        let mut r = StreamRedactor::new(p.clone());
        let mut released = 0;
        for _ in 0..1000 {
            released += r.push(b"sk-test-abcdef12345").len();
            assert!(r.held.len() < p.max_len);
        }
        released += r.finish().len();
        assert_eq!(released, 19 * 1000);
    }

    #[test]
    fn no_secrets_change_nothing() {
        let p = Arc::new(Patterns::new([]));
        assert!(p.is_empty());
        let mut r = StreamRedactor::new(p.clone());
        assert_eq!(r.push(b"abc"), b"abc");
        assert_eq!(p.redact_str("abc"), "abc");
    }
}
