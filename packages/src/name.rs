//! Package names and the patterns of allow and deny lists.

/// A PyPI project name as PEP 503 compares them: lowercase, every run of `-`, `_` and `.` one
/// `-`. npm names are compared as given (the registry already requires lowercase).
pub fn normalize_pypi(name: &str) -> String {
    // `re.sub(r"[-_.]+", "-", name).lower()`, as PEP 503 gives it.
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !sep {
                out.push('-');
            }
            sep = true;
            continue;
        }
        sep = false;
        out.extend(c.to_lowercase());
    }
    out
}

/// Whether `name` is a project name PyPI could hold (letters, digits, `-_.`; starting and
/// ending with a letter or digit; at most 200 characters). Anything else is refused before a
/// registry is asked.
pub fn valid_pypi(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 200
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Whether `name` is an npm package name the proxy serves: `name` or `@scope/name`, each part
/// of lowercase letters, digits and `-._~`, not starting with `.` or `_`, at most 214 bytes.
pub fn valid_npm(name: &str) -> bool {
    if name.is_empty() || name.len() > 214 {
        return false;
    }
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '_'])
            && p.bytes().all(|c| {
                c.is_ascii_lowercase()
                    || c.is_ascii_digit()
                    || matches!(c, b'-' | b'.' | b'_' | b'~')
            })
    };
    match name.strip_prefix('@') {
        Some(scoped) => match scoped.split_once('/') {
            Some((scope, rest)) => part(scope) && part(rest),
            None => false,
        },
        None => part(name),
    }
}

/// A name pattern: a name, or a name with `*` standing for any run of characters
/// (`types-*`, `@acme/*`, `*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    text: String,
}

impl Pattern {
    /// Parses a pattern for a registry kind's names (PyPI patterns are normalised like names).
    pub fn new(text: &str, pypi: bool) -> Result<Self, String> {
        let t = text.trim();
        if t.is_empty() || t.len() > 214 {
            return Err(format!(
                "package pattern {text:?}: empty or longer than 214 bytes"
            ));
        }
        if !t.bytes().all(|c| {
            c.is_ascii_alphanumeric()
                || matches!(c, b'-' | b'_' | b'.' | b'~' | b'@' | b'/' | b'*' | b'+')
        }) {
            return Err(format!(
                "package pattern {text:?}: only letters, digits, `-_.~@/+` and `*` may appear"
            ));
        }
        let text = if pypi {
            // Normalise the parts between the stars, keeping the stars.
            t.split('*')
                .map(normalize_pypi)
                .collect::<Vec<_>>()
                .join("*")
        } else {
            t.to_ascii_lowercase()
        };
        Ok(Self { text })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `name` (already normalised for its kind) matches.
    pub fn matches(&self, name: &str) -> bool {
        glob(self.text.as_bytes(), name.as_bytes())
    }
}

/// `*`-only glob matching, iterative (no backtracking blow-up: the last star is the only one
/// retried).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pep503_normalisation() {
        assert_eq!(normalize_pypi("Foo_Bar"), "foo-bar");
        assert_eq!(normalize_pypi("foo.-_bar"), "foo-bar");
        assert_eq!(normalize_pypi("Django"), "django");
        assert_eq!(normalize_pypi("zope.interface"), "zope-interface");
    }

    #[test]
    fn names_checked() {
        assert!(valid_pypi("requests"));
        assert!(valid_pypi("zope.interface"));
        assert!(!valid_pypi("../etc"));
        assert!(!valid_pypi("-x"));
        assert!(!valid_pypi(""));
        assert!(!valid_pypi(&"a".repeat(201)));
        assert!(valid_npm("left-pad"));
        assert!(valid_npm("@acme/tool"));
        assert!(!valid_npm("@acme"));
        assert!(!valid_npm("Upper"));
        assert!(!valid_npm("../x"));
        assert!(!valid_npm(".hidden"));
    }

    #[test]
    fn patterns() {
        let p = Pattern::new("Types_*", true).unwrap();
        assert_eq!(p.as_str(), "types-*");
        assert!(p.matches("types-requests"));
        assert!(!p.matches("requests"));
        assert!(Pattern::new("*", true).unwrap().matches("anything"));
        let n = Pattern::new("@acme/*", false).unwrap();
        assert!(n.matches("@acme/tool"));
        assert!(!n.matches("@other/tool"));
        assert!(Pattern::new("a*b*c", false).unwrap().matches("axxbyyc"));
        assert!(!Pattern::new("a*b*c", false).unwrap().matches("axxbyy"));
        assert!(Pattern::new("bad pattern", true).is_err());
        // Debian names have `+` (`g++`, `libstdc++6`).
        assert!(
            Pattern::new("libstdc++*", false)
                .unwrap()
                .matches("libstdc++6")
        );
        assert!(Pattern::new("", true).is_err());
        // Many stars against a long name stay linear.
        let many = Pattern::new(&"a*".repeat(50), false).unwrap();
        assert!(!many.matches(&format!("{}b", "a".repeat(49))));
    }
}
