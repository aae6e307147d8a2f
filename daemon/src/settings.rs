//! The settings file as a whole: the daemon's own settings ([`Config`], which composes the
//! sections of the parts below it) and the sections of the parts above the daemon, each their
//! owner's type: `[cluster]` (`cluster::ClusterConfig`) and `[e2b]` (`e2b::E2bConfig`). The file
//! keeps its one flat TOML layout; only its reading is split.

use std::path::Path;

use crate::cluster::ClusterConfig;
use crate::config::{Config, is_loopback};
use crate::e2b::E2bConfig;
use crate::error::StartError;

/// Everything `--config FILE` sets.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    pub daemon: Config,
    /// Cluster mode: several nodes coordinated through etcd (off unless `[cluster] etcd` is
    /// set; see `cluster/mod.rs`).
    pub cluster: ClusterConfig,
    /// The E2B-compatible gateway (off unless `[e2b] listen` is set; see `e2b/mod.rs`).
    pub e2b: E2bConfig,
}

impl Settings {
    /// Reads a TOML file over the defaults.
    pub fn load(path: &Path) -> Result<Self, StartError> {
        let text = std::fs::read_to_string(path)
            .map_err(StartError::io(format!("reading {}", path.display())))?;
        Self::parse(&text).map_err(|e| StartError::Setting(format!("{}: {e}", path.display())))
    }

    /// Parses the file's text: an unknown key, in any section, is an error.
    pub fn parse(text: &str) -> Result<Self, StartError> {
        let mut table: toml::Table = text
            .parse()
            .map_err(|e| StartError::Setting(format!("{e}")))?;
        let cluster = section(&mut table, "cluster")?;
        let e2b = section(&mut table, "e2b")?;
        let daemon = table
            .try_into()
            .map_err(|e| StartError::Setting(format!("{e}")))?;
        Ok(Self {
            daemon,
            cluster,
            e2b,
        })
    }

    /// Checks what the settings expose: the daemon's listeners and metrics
    /// ([`Config::check_exposure`]) and the E2B gateway, which off loopback needs TLS too.
    pub fn check_exposure(&self) -> Result<(), StartError> {
        self.daemon.check_exposure()?;
        let e2b = &self.e2b.listen;
        if !e2b.is_empty()
            && self.daemon.tls.is_none()
            && !self.daemon.allow_insecure_tcp
            && !is_loopback(e2b)
        {
            return Err(StartError::Setting(format!(
                "[e2b] listen {e2b}: off loopback the gateway needs [tls] (API keys and access \
                 tokens would cross the network in clear; allow_insecure_tcp = true allows it)"
            )));
        }
        Ok(())
    }
}

/// Takes `[name]` out of `table` as its owner's type (its defaults when absent).
fn section<T: serde::de::DeserializeOwned + Default>(
    table: &mut toml::Table,
    name: &str,
) -> Result<T, StartError> {
    match table.remove(name) {
        None => Ok(T::default()),
        Some(value) => value
            .try_into()
            .map_err(|e| StartError::Setting(format!("[{name}] {e}"))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn each_section_goes_to_its_owner_and_unknown_keys_are_refused_everywhere() {
        let s = Settings::parse(
            "pool_size = 3\n[e2b]\nlisten = \"127.0.0.1:3000\"\n[cluster]\nnode = \"n1\"\n\
             [jail]\nenabled = false\n",
        )
        .unwrap();
        assert_eq!(s.daemon.pool_size, 3);
        assert_eq!(s.e2b.listen, "127.0.0.1:3000");
        assert_eq!(s.e2b.default_timeout_s, 300, "unset keys keep defaults");
        assert_eq!(s.cluster.node, "n1");
        assert!(!s.cluster.enabled());
        assert!(!s.daemon.jail.enabled);
        for bad in [
            "pool_sise = 1",
            "[e2b]\nlisen = \"x\"",
            "[cluster]\nnodes = \"n\"",
            "[jail]\nenable = true",
            "pool_size = ",
        ] {
            assert!(Settings::parse(bad).is_err(), "{bad}");
        }
        let e = Settings::parse("[e2b]\nlisen = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("[e2b] unknown field `lisen`"), "{e}");
        assert_eq!(Settings::parse("").unwrap().e2b.listen, "");
    }

    #[test]
    fn the_gateway_off_loopback_needs_tls() {
        let exposed = |text: &str| Settings::parse(text).unwrap().check_exposure();
        assert!(exposed("[e2b]\nlisten = \"0.0.0.0:3000\"").is_err());
        assert!(exposed("[e2b]\nlisten = \"127.0.0.1:3000\"").is_ok());
        assert!(exposed("allow_insecure_tcp = true\n[e2b]\nlisten = \"0.0.0.0:3000\"").is_ok());
        assert!(
            exposed("[tls]\ncert = \"/c\"\nkey = \"/k\"\n[e2b]\nlisten = \"0.0.0.0:3000\"").is_ok()
        );
        assert!(
            exposed("listen = [\"tcp://0.0.0.0:7000\"]").is_err(),
            "the daemon's own checks still run"
        );
    }

    #[test]
    fn the_example_a_node_is_deployed_with_is_read() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd/airlockd.toml.example");
        let s = Settings::load(&path).unwrap();
        s.check_exposure().unwrap();
    }
}
