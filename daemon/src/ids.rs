//! Ids and names: the kinds of ids ([`Kind`]: `sb-`, `ex-`, `tpl-`, `vm-`, `vol-`, ... and 16
//! random hex digits, made by the shared `airlock_proto::identity`), template names, and the
//! wall clock of records. In cluster mode the first 4 hex digits of sandbox and execution ids
//! are the node's tag, so any node knows from an id which node holds it.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// What an id names; its prefix says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sandbox,
    Execution,
    Template,
    Vmm,
    Volume,
    /// An E2B template build.
    Build,
    /// A template's files being fetched from another node (a temporary directory).
    Fetch,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Sandbox,
        Kind::Execution,
        Kind::Template,
        Kind::Vmm,
        Kind::Volume,
        Kind::Build,
        Kind::Fetch,
    ];

    /// The prefix before the `-`.
    pub fn prefix(self) -> &'static str {
        match self {
            Kind::Sandbox => "sb",
            Kind::Execution => "ex",
            Kind::Template => "tpl",
            Kind::Vmm => "vm",
            Kind::Volume => "vol",
            Kind::Build => "bld",
            Kind::Fetch => "f",
        }
    }

    /// Whether `id` is a well-formed id of this kind (prefix, `-`, 16 hex digits).
    pub fn names(self, id: &str) -> bool {
        airlock_proto::identity::well_formed(id, self.prefix())
    }

    /// The kind of a well-formed `id`.
    pub fn of(id: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.names(id))
    }
}

/// Cluster mode: this node's tag (4 hex digits), set once when it joins.
static NODE_TAG: OnceLock<String> = OnceLock::new();

/// Sets this node's tag (cluster mode, once, before any sandbox is made); false if it was set
/// to another one already.
pub fn set_node_tag(tag: &str) -> bool {
    valid_tag(tag) && NODE_TAG.get_or_init(|| tag.to_owned()) == tag
}

/// Whether `tag` is 4 lower-case hex digits.
pub fn valid_tag(tag: &str) -> bool {
    tag.len() == 4
        && tag
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// The node tag an id of a sandbox or an execution carries (its first 4 hex digits).
pub fn tag_of(id: &str) -> Option<&str> {
    if !matches!(Kind::of(id), Some(Kind::Sandbox | Kind::Execution)) {
        return None;
    }
    id.get(3..7)
}

/// A new random id of `kind`; sandbox and execution ids start with the node's tag in cluster
/// mode.
pub fn new_id(kind: Kind) -> std::io::Result<String> {
    let id = airlock_proto::identity::new_id(kind.prefix())
        .map_err(|e| std::io::Error::other(format!("making an id: {e}")))?;
    match NODE_TAG.get() {
        Some(tag) if matches!(kind, Kind::Sandbox | Kind::Execution) => Ok(with_tag(&id, tag)),
        _ => Ok(id),
    }
}

/// `id` with its first 4 hex digits replaced by `tag`.
fn with_tag(id: &str, tag: &str) -> String {
    let (head, rest) = id.split_at(id.find('-').map_or(0, |i| i + 1));
    format!("{head}{tag}{}", rest.get(4..).unwrap_or_default())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Template names: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ids_carry_their_prefix() {
        for kind in Kind::ALL {
            let a = new_id(kind).unwrap();
            assert!(kind.names(&a), "{a}");
            assert_eq!(
                Kind::of(&a),
                Some(kind),
                "{a}: prefixes are not prefixes of each other"
            );
        }
        assert_eq!(Kind::of("sb-../../etc"), None);
    }

    #[test]
    fn tagged_ids_name_their_node_and_stay_well_formed() {
        let id = with_tag("sb-0123456789abcdef", "beef");
        assert_eq!(id, "sb-beef456789abcdef");
        assert!(Kind::Sandbox.names(&id));
        assert_eq!(tag_of(&id), Some("beef"));
        assert_eq!(tag_of("ex-beef456789abcdef"), Some("beef"));
        assert_eq!(tag_of("tpl-beef456789abcdef"), None);
        assert_eq!(tag_of("sb-../../etc"), None);
        assert!(valid_tag("00af"));
        assert!(!valid_tag("00AF"));
        assert!(!valid_tag("abc"));
    }

    #[test]
    fn template_names_are_checked() {
        assert!(valid_name("base"));
        assert!(valid_name("py3.12-data"));
        assert!(!valid_name(""));
        assert!(!valid_name("Base"));
        assert!(!valid_name("../x"));
        assert!(!valid_name(&"a".repeat(64)));
    }
}
