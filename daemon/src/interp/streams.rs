//! A cell's stdout and stderr redacted as streams: a secret value the kernel printed in two
//! pieces is still replaced. What could begin a value is held back until the stream's next
//! piece, or until a result, an error or the cell's end releases it (so events keep their
//! order); a UTF-8 character cut by the hold waits for its other bytes.

use std::sync::Arc;

use crate::secrets::redact::{Patterns, StreamRedactor};

/// One stream's redaction.
#[derive(Debug)]
struct Stream {
    redactor: StreamRedactor,
    /// Redacted bytes not yet shown: the start of a UTF-8 character.
    carry: Vec<u8>,
}

/// stdout's (0) and stderr's (1) redaction.
#[derive(Debug)]
pub struct Streams {
    streams: [Stream; 2],
}

impl Streams {
    pub fn new(patterns: &Arc<Patterns>) -> Self {
        let stream = || Stream {
            redactor: StreamRedactor::new(patterns.clone()),
            carry: Vec::new(),
        };
        Self {
            streams: [stream(), stream()],
        }
    }

    /// The redacted text that `text`, a piece of stream `i`, releases now (may be empty).
    pub fn push(&mut self, i: usize, text: &str) -> String {
        let s = &mut self.streams[i.min(1)];
        let out = s.redactor.push(text.as_bytes());
        s.carry.extend_from_slice(&out);
        take_utf8(&mut s.carry)
    }

    /// Everything held back, by stream (empty texts left out).
    pub fn flush(&mut self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for (i, s) in self.streams.iter_mut().enumerate() {
            let rest = s.redactor.finish();
            s.carry.extend_from_slice(&rest);
            let text = String::from_utf8_lossy(&s.carry).into_owned();
            s.carry.clear();
            if !text.is_empty() {
                out.push((i, text));
            }
        }
        out
    }
}

/// The longest prefix of `carry` that is whole UTF-8, taken out of it (an invalid sequence is
/// taken too, replaced).
fn take_utf8(carry: &mut Vec<u8>) -> String {
    let n = match std::str::from_utf8(carry) {
        Ok(_) => carry.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => carry.len(),
    };
    let text = String::from_utf8_lossy(&carry[..n]).into_owned();
    carry.drain(..n);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_in_two_pieces_is_redacted_and_characters_stay_whole() {
        let p = Arc::new(Patterns::new([("KEY", b"hunter2-secret".as_slice())]));
        let mut s = Streams::new(&p);
        let mut shown = s.push(0, "é value: hunter2-");
        shown += &s.push(0, "secret! ü");
        assert!(s.push(1, "err").len() <= 3);
        for (i, rest) in s.flush() {
            if i == 0 {
                shown += &rest;
            }
        }
        assert_eq!(shown, "é value: [REDACTED:KEY]! ü");
        let mut carry = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_utf8(&mut carry), "");
        carry.push("é".as_bytes()[1]);
        assert_eq!(take_utf8(&mut carry), "é");
        assert!(carry.is_empty());
    }
}
