//! A restored clone's identity: host entropy and ids. Every clone of a snapshot starts with its
//! siblings' RNG state and host name; the host gives each its own with `Reseed` (see
//! [`AgentClient::reseed_clone`](crate::AgentClient::reseed_clone)). Shared by `airlock-vmm
//! run` and `airlockd`.

/// Bytes of entropy a clone gets.
pub const CLONE_ENTROPY_BYTES: usize = 64;

/// Fills `buf` from the kernel's CSPRNG (`getrandom(2)`).
pub fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    getrandom::fill(buf).map_err(|e| std::io::Error::other(format!("getrandom: {e}")))
}

/// `prefix-` and 16 random hex digits (`sb-0123456789abcdef`).
pub fn new_id(prefix: &str) -> std::io::Result<String> {
    let mut b = [0u8; 8];
    random_bytes(&mut b)?;
    Ok(id_from(prefix, &b))
}

/// `prefix-` and the bytes in hex.
pub fn id_from(prefix: &str, bytes: &[u8]) -> String {
    let hex: String = bytes.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// Whether `id` looks like an id made by [`new_id`] with `prefix` (checked before it names a
/// file or a cgroup).
pub fn well_formed(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|c| c.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ids_are_well_formed_and_distinct() {
        let a = new_id("sb").unwrap();
        let b = new_id("sb").unwrap();
        assert_ne!(a, b);
        assert!(well_formed(&a, "sb"));
        assert!(!well_formed(&a, "ex"));
        assert!(!well_formed("sb-../../etc/passwd", "sb"));
        assert!(!well_formed("sb-0123456789abcdef0", "sb"));
        assert_eq!(id_from("vm", &[0, 255]), "vm-00ff");
    }
}
