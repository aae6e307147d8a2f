//! Debian repositories, as apt reads them: a suite's `InRelease` (a Release file with an inline
//! OpenPGP signature), the files it lists with their SHA-256, and the `Packages` indexes that
//! list each `.deb` with its digest. The signature itself is checked by `gpgv` (the daemon runs
//! it); here is what decides on its status lines, and the parsing of what it verified.
//!
//! Every function takes bounded input and returns an error instead of panicking.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use crate::{MAX_FILES, ParseError};

/// A file a verified Release lists (a path under `dists/SUITE/`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// What a verified Release says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Release {
    /// `Suite` and `Codename` (either may name the suite a client asked for).
    pub suite: String,
    pub codename: String,
    /// Listed files by path relative to `dists/SUITE/`.
    pub files: BTreeMap<String, Listed>,
}

impl Release {
    /// The listed file a path asks for: the path itself, or `DIR/by-hash/SHA256/HEX` for a file
    /// in DIR with that digest (apt's `Acquire-By-Hash`). Returns the listed path too.
    pub fn lookup<'a>(&'a self, path: &str) -> Option<(&'a str, &'a Listed)> {
        if let Some((k, l)) = self.files.get_key_value(path) {
            return Some((k.as_str(), l));
        }
        let (dir, hex) = path.rsplit_once("/by-hash/SHA256/")?;
        self.files.iter().find_map(|(k, l)| {
            let in_dir = k.rsplit_once('/').map_or("", |(d, _)| d) == dir;
            (in_dir && l.sha256 == hex).then_some((k.as_str(), l))
        })
    }

    /// Whether the Release is the one of `suite` (its Suite or Codename).
    pub fn is_of(&self, suite: &str) -> bool {
        self.suite == suite || self.codename == suite
    }
}

/// One package of a `Packages` index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deb {
    pub package: String,
    pub version: String,
    pub architecture: String,
    /// Relative to the repository's root (`pool/main/h/hello/hello_2.10-3_amd64.deb`).
    pub filename: String,
    pub size: u64,
    pub sha256: String,
}

/// Whether `name` is a Debian package name (Debian Policy 5.6.1: lowercase letters, digits,
/// `+ - .`, at least two characters, starting with a letter or digit).
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    (2..=128).contains(&b.len())
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'+' | b'-' | b'.')
        })
}

/// Whether `s` is one safe path segment of a repository (a suite, a component, a file name):
/// letters, digits and `._+~-`, not `.` or `..`, at most 128 bytes.
pub fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'+' | b'~' | b'-'))
}

/// Whether `path` is a relative path of safe segments ([`valid_segment`]), at most 16 deep.
pub fn valid_path(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    parts.len() <= 16 && parts.iter().all(|p| valid_segment(p))
}

fn hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// A clearsigned file's shape, as apt accepts it: the signed-message header first, one
/// signature block last, nothing outside (whitespace aside). Text outside the signed part is
/// what an attacker would add to a validly signed file; refusing it keeps what the client
/// parses and what was verified the same.
pub fn check_clearsigned(body: &[u8]) -> Result<(), String> {
    const BEGIN: &str = "-----BEGIN PGP SIGNED MESSAGE-----";
    const SIG: &str = "-----BEGIN PGP SIGNATURE-----";
    const END: &str = "-----END PGP SIGNATURE-----";
    let text = std::str::from_utf8(body).map_err(|_| "InRelease is not UTF-8".to_owned())?;
    let text = text.trim();
    if !text.starts_with(BEGIN) || !text.ends_with(END) {
        return Err("InRelease is not one clearsigned message (text outside it)".into());
    }
    if text.matches(BEGIN).count() != 1
        || text.matches(SIG).count() != 1
        || text.matches(END).count() != 1
    {
        return Err("InRelease holds more than one signed message or signature block".into());
    }
    Ok(())
}

/// The verdict on `gpgv --status-fd`'s lines: the fingerprints of the good signatures, if at
/// least one signature is good (made with SHA-224 or stronger, by a key in the keyring, not
/// expired or revoked) and none is bad. Signatures by keys outside the keyring are passed over
/// as apt passes them over (Debian signs with several keys).
pub fn signature_verdict(status: &str) -> Result<Vec<String>, String> {
    let mut good = Vec::new();
    let mut unknown = Vec::new();
    for line in status.lines() {
        let Some(rest) = line.strip_prefix("[GNUPG:] ") else {
            continue;
        };
        let mut f = rest.split_whitespace();
        match f.next() {
            Some("BADSIG") => {
                return Err(format!(
                    "a BAD signature by key {} (the file was altered after signing)",
                    f.next().unwrap_or("?")
                ));
            }
            Some(k @ ("EXPKEYSIG" | "REVKEYSIG" | "EXPSIG")) => {
                let why = match k {
                    "EXPKEYSIG" => "an expired key",
                    "REVKEYSIG" => "a revoked key",
                    _ => "an expired signature",
                };
                return Err(format!("signed by {why} ({})", f.next().unwrap_or("?")));
            }
            Some("VALIDSIG") => {
                let fields: Vec<&str> = f.collect();
                let fpr = fields.first().copied().unwrap_or("?");
                // VALIDSIG fpr date ts expire version reserved pk-algo hash-algo class [primary]
                let hash: u32 = fields.get(7).and_then(|h| h.parse().ok()).unwrap_or(0);
                if !matches!(hash, 8..=11) {
                    return Err(format!(
                        "signed by {fpr} with a weak digest (OpenPGP hash algorithm {hash}; \
                         SHA-224 or stronger is required)"
                    ));
                }
                good.push(fpr.to_owned());
            }
            Some("NO_PUBKEY") => unknown.push(f.next().unwrap_or("?").to_owned()),
            _ => {}
        }
    }
    if good.is_empty() {
        return Err(if unknown.is_empty() {
            "no valid signature".to_owned()
        } else {
            format!(
                "signed only by keys outside the registry's keyring ({})",
                unknown.join(", ")
            )
        });
    }
    Ok(good)
}

/// deb822 paragraphs: (field, value) pairs, continuation lines joined with `\n`.
fn paragraphs(text: &str) -> Vec<Vec<(&str, String)>> {
    let mut out = Vec::new();
    let mut cur: Vec<(&str, String)> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        } else if line.starts_with([' ', '\t']) {
            if let Some((_, v)) = cur.last_mut() {
                v.push('\n');
                v.push_str(line.trim());
            }
        } else if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim(), v.trim().to_owned()));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn field<'a>(p: &'a [(&str, String)], name: &str) -> Option<&'a str> {
    p.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The verified text of a Release (what `gpgv --output` wrote): its suite and SHA-256 list.
pub fn parse_release(text: &str) -> Result<Release, ParseError> {
    let bad = |m: String| ParseError::Malformed("Release", m);
    let paras = paragraphs(text);
    let p = paras.first().ok_or_else(|| bad("empty".into()))?;
    let mut files = BTreeMap::new();
    let list = field(p, "SHA256").ok_or_else(|| bad("no SHA256 field".into()))?;
    for line in list.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let (Some(sha), Some(size), Some(path), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            return Err(bad(format!("SHA256 line {line:?}")));
        };
        let size: u64 = size.parse().map_err(|_| bad(format!("size in {line:?}")))?;
        if !hex64(sha) || !valid_path(path) {
            return Err(bad(format!("SHA256 line {line:?}")));
        }
        if files.len() >= MAX_FILES {
            return Err(ParseError::TooManyFiles);
        }
        files.insert(
            path.to_owned(),
            Listed {
                size,
                sha256: sha.to_owned(),
            },
        );
    }
    Ok(Release {
        suite: field(p, "Suite").unwrap_or("").to_owned(),
        codename: field(p, "Codename").unwrap_or("").to_owned(),
        files,
    })
}

/// Whether a listed path is a `Packages` index (`COMPONENT/binary-ARCH/Packages[.gz|.xz]`).
pub fn is_packages_index(path: &str) -> bool {
    let Some((dir, file)) = path.rsplit_once('/') else {
        return false;
    };
    dir.rsplit('/')
        .next()
        .is_some_and(|d| d.starts_with("binary-"))
        && matches!(file, "Packages" | "Packages.gz" | "Packages.xz")
}

/// The packages of an index; stanzas without a usable file (no Filename, SHA256 or Size, or a
/// path outside `pool/`) are skipped, a malformed one is an error.
pub fn parse_packages(text: &str) -> Result<Vec<Deb>, ParseError> {
    let bad = |m: String| ParseError::Malformed("Packages index", m);
    let mut out = Vec::new();
    for p in paragraphs(text) {
        let (Some(package), Some(filename), Some(sha256), Some(size)) = (
            field(&p, "Package"),
            field(&p, "Filename"),
            field(&p, "SHA256"),
            field(&p, "Size"),
        ) else {
            continue;
        };
        if !valid_name(package) {
            return Err(bad(format!("package name {package:?}")));
        }
        if !filename.starts_with("pool/") || !valid_path(filename) || !hex64(sha256) {
            return Err(bad(format!(
                "the file of {package}: {filename:?} {sha256:?}"
            )));
        }
        let size = size
            .parse()
            .map_err(|_| bad(format!("the size of {package}")))?;
        if out.len() >= MAX_FILES {
            return Err(ParseError::TooManyFiles);
        }
        out.push(Deb {
            package: package.to_owned(),
            version: field(&p, "Version").unwrap_or("").to_owned(),
            architecture: field(&p, "Architecture").unwrap_or("").to_owned(),
            filename: filename.to_owned(),
            size,
            sha256: sha256.to_owned(),
        });
    }
    Ok(out)
}

/// A writer that refuses to hold more than `max` bytes (a decompression bomb stops there).
struct Capped {
    buf: Vec<u8>,
    max: u64,
    over: bool,
}

impl Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() as u64 + b.len() as u64 > self.max {
            self.over = true;
            return Err(std::io::Error::other("over the limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An index file's content, decompressed by its name's suffix (`.xz`, `.gz`, none), at most
/// `max` bytes of it.
pub fn decompress(path: &str, body: &[u8], max: u64) -> Result<Vec<u8>, ParseError> {
    let over = || {
        ParseError::Malformed(
            "compressed index",
            format!("{path} unpacks to more than {max} bytes"),
        )
    };
    let mut out = Capped {
        buf: Vec::new(),
        max,
        over: false,
    };
    if path.ends_with(".xz") {
        lzma_rs::xz_decompress(&mut std::io::BufReader::new(body), &mut out).map_err(|e| {
            if out.over {
                over()
            } else {
                ParseError::Malformed("xz data", format!("{path}: {e}"))
            }
        })?;
    } else if path.ends_with(".gz") {
        let mut d = flate2::read::GzDecoder::new(body).take(max + 1);
        let mut buf = Vec::new();
        d.read_to_end(&mut buf)
            .map_err(|e| ParseError::Malformed("gzip data", format!("{path}: {e}")))?;
        if buf.len() as u64 > max {
            return Err(over());
        }
        out.buf = buf;
    } else {
        if body.len() as u64 > max {
            return Err(over());
        }
        out.buf = body.to_vec();
    }
    Ok(out.buf)
}

#[cfg(test)]
#[path = "debian_tests.rs"]
mod tests;
