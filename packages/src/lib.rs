//! What a sandbox may install, and the registry formats airlockd's package proxy reads and
//! writes. Everything here is pure: the daemon fetches and serves, this decides and parses.
//!
//! - [`name`]: package names (PEP 503 normalisation) and the patterns of allow and deny lists;
//! - [`policy`]: a tenant's ceiling and a sandbox's policy combined, and its verdicts;
//! - [`pypi`]: the simple index, PEP 503 HTML and PEP 691 JSON, parsed and written;
//! - [`npm`]: packuments (the registry's document of a package), parsed and rewritten;
//! - [`debian`]: a Debian repository's Release (its verified file list) and Packages indexes.
//!
//! Every parser takes a body the caller already bounded in size, caps what it keeps (files per
//! page, versions per package) and returns an error instead of panicking on any input.

pub mod debian;
pub mod name;
pub mod npm;
pub mod policy;
pub mod pypi;

/// Files (PyPI) or versions (npm) kept from one index page or packument; more are an error.
pub const MAX_FILES: usize = 100_000;

/// Why a registry's answer could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("the registry's answer is not valid {0}: {1}")]
    Malformed(&'static str, String),
    #[error("the registry's answer lists more than {MAX_FILES} files")]
    TooManyFiles,
}
