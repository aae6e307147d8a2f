//! A sandbox's package policy: the operator's ceiling for its tenant first, narrowed by what
//! the sandbox asked for, never widened.

use std::fmt;

use crate::name::Pattern;

/// A policy as given (the settings' ceiling, or a request's `PackagePolicy`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parts {
    /// Registry names; empty: every registry (of the ceiling, for a request).
    pub registries: Vec<String>,
    /// Package patterns; empty: any package.
    pub allow: Vec<String>,
    pub deny: Vec<String>,
    pub offline: bool,
    /// 0: no cap (of the ceiling's, for a request).
    pub max_download_bytes: u64,
}

/// Why a ceiling and a request do not combine into a policy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The ceiling (the operator's settings) names a registry the daemon lacks.
    #[error("the ceiling names registry {0:?}, which is not configured")]
    CeilingRegistryUnknown(String),
    /// The request asks for a registry the daemon has but the tenant's ceiling does not allow.
    #[error("registry {0:?} is beyond the tenant's ceiling")]
    BeyondCeiling(String),
    /// The request asks for a registry the daemon lacks.
    #[error("registry {name:?} is not configured (known: {known})")]
    RegistryUnknown { name: String, known: String },
    /// A malformed package pattern.
    #[error("{0}")]
    Pattern(String),
}

/// Whose rule it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Tenant,
    Sandbox,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Tenant => "the tenant's ceiling",
            Source::Sandbox => "the sandbox's policy",
        })
    }
}

/// One list's patterns, compiled for both kinds of names.
#[derive(Clone, Debug, PartialEq, Eq)]
struct List {
    source: Source,
    raw: Vec<String>,
    pypi: Vec<Pattern>,
    npm: Vec<Pattern>,
}

impl List {
    fn new(source: Source, raw: &[String]) -> Result<Self, String> {
        Ok(Self {
            source,
            raw: raw.iter().map(|r| r.trim().to_owned()).collect(),
            pypi: raw
                .iter()
                .map(|r| Pattern::new(r, true))
                .collect::<Result<_, _>>()?,
            npm: raw
                .iter()
                .map(|r| Pattern::new(r, false))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The first pattern matching `name`, as written.
    fn find(&self, pypi: bool, name: &str) -> Option<&str> {
        let pats = if pypi { &self.pypi } else { &self.npm };
        pats.iter()
            .position(|p| p.matches(name))
            .map(|i| self.raw[i].as_str())
    }
}

/// The policy in force for a sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    registries: Vec<String>,
    /// Every non-empty allowlist must match (the ceiling's and the sandbox's).
    allow: Vec<List>,
    deny: Vec<List>,
    offline: Option<Source>,
    /// 0: no cap.
    pub max_download_bytes: u64,
}

/// Why a request is refused; its text is what the client and the install log show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    Offline(Source),
    Registry(String),
    NotAllowed {
        package: String,
        source: Source,
    },
    Denied {
        package: String,
        pattern: String,
        source: Source,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Offline(s) => write!(f, "offline mode ({s}): no package installs"),
            Refusal::Registry(r) => {
                write!(
                    f,
                    "registry {r} is not allowed by the sandbox's package policy"
                )
            }
            Refusal::NotAllowed { package, source } => {
                write!(f, "package {package} is not on the allowlist of {source}")
            }
            Refusal::Denied {
                package,
                pattern,
                source,
            } => write!(f, "package {package} is denied by {pattern:?} in {source}"),
        }
    }
}

impl Policy {
    /// The ceiling narrowed by `asked`. `known`: the registries the daemon has. Fails, naming
    /// it, for a registry the ceiling does not allow or the daemon does not know, and for a
    /// malformed pattern.
    pub fn combine(ceiling: &Parts, asked: &Parts, known: &[String]) -> Result<Self, PolicyError> {
        for r in &ceiling.registries {
            if !known.contains(r) {
                return Err(PolicyError::CeilingRegistryUnknown(r.clone()));
            }
        }
        let ceiling_regs: Vec<String> = if ceiling.registries.is_empty() {
            known.to_vec()
        } else {
            ceiling.registries.clone()
        };
        let registries = if asked.registries.is_empty() {
            ceiling_regs
        } else {
            for r in &asked.registries {
                if !ceiling_regs.contains(r) {
                    return Err(if known.contains(r) {
                        PolicyError::BeyondCeiling(r.clone())
                    } else {
                        PolicyError::RegistryUnknown {
                            name: r.clone(),
                            known: known.join(", "),
                        }
                    });
                }
            }
            let mut regs = asked.registries.clone();
            regs.dedup();
            regs
        };
        let mut allow = Vec::new();
        let mut deny = Vec::new();
        for (source, parts) in [(Source::Tenant, ceiling), (Source::Sandbox, asked)] {
            if !parts.allow.is_empty() {
                allow.push(List::new(source, &parts.allow).map_err(PolicyError::Pattern)?);
            }
            if !parts.deny.is_empty() {
                deny.push(List::new(source, &parts.deny).map_err(PolicyError::Pattern)?);
            }
        }
        let offline = if ceiling.offline {
            Some(Source::Tenant)
        } else if asked.offline {
            Some(Source::Sandbox)
        } else {
            None
        };
        let max_download_bytes = match (ceiling.max_download_bytes, asked.max_download_bytes) {
            (0, a) => a,
            (c, 0) => c,
            (c, a) => c.min(a),
        };
        Ok(Self {
            registries,
            allow,
            deny,
            offline,
            max_download_bytes,
        })
    }

    /// Whether anything may come from `registry` (offline refuses everything first).
    pub fn registry(&self, registry: &str) -> Result<(), Refusal> {
        if let Some(s) = self.offline {
            return Err(Refusal::Offline(s));
        }
        if !self.registries.iter().any(|r| r == registry) {
            return Err(Refusal::Registry(registry.to_owned()));
        }
        Ok(())
    }

    /// Whether package `name` (normalised for its kind) may come from `registry`.
    pub fn package(&self, registry: &str, pypi: bool, name: &str) -> Result<(), Refusal> {
        self.registry(registry)?;
        for l in &self.deny {
            if let Some(p) = l.find(pypi, name) {
                return Err(Refusal::Denied {
                    package: name.to_owned(),
                    pattern: p.to_owned(),
                    source: l.source,
                });
            }
        }
        for l in &self.allow {
            if l.find(pypi, name).is_none() {
                return Err(Refusal::NotAllowed {
                    package: name.to_owned(),
                    source: l.source,
                });
            }
        }
        Ok(())
    }

    /// The policy in force, as one `Parts` to show: its registries, offline and cap; the
    /// deny lists together; the sandbox's allowlist if it has one, else the ceiling's (the
    /// ceiling's allowlist holds as well).
    pub fn to_parts(&self) -> Parts {
        Parts {
            registries: self.registries.clone(),
            allow: self.allow.last().map(|l| l.raw.clone()).unwrap_or_default(),
            deny: self
                .deny
                .iter()
                .flat_map(|l| l.raw.iter().cloned())
                .collect(),
            offline: self.offline.is_some(),
            max_download_bytes: self.max_download_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known() -> Vec<String> {
        vec!["pypi".into(), "npm".into(), "mirror".into()]
    }

    fn parts(regs: &[&str], allow: &[&str], deny: &[&str]) -> Parts {
        Parts {
            registries: regs.iter().map(|s| s.to_string()).collect(),
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn an_open_ceiling_and_an_empty_request_allow_every_registry_and_package() {
        let p = Policy::combine(&Parts::default(), &Parts::default(), &known()).unwrap();
        assert!(p.package("pypi", true, "requests").is_ok());
        assert!(p.package("mirror", true, "requests").is_ok());
        assert_eq!(p.max_download_bytes, 0);
    }

    #[test]
    fn a_request_narrows_registries_and_cannot_widen_them() {
        let ceiling = parts(&["pypi", "npm"], &[], &[]);
        let p = Policy::combine(&ceiling, &parts(&["pypi"], &[], &[]), &known()).unwrap();
        assert!(p.registry("pypi").is_ok());
        assert_eq!(p.registry("npm"), Err(Refusal::Registry("npm".into())));
        let e = Policy::combine(&ceiling, &parts(&["mirror"], &[], &[]), &known()).unwrap_err();
        assert_eq!(e, PolicyError::BeyondCeiling("mirror".into()));
        assert_eq!(
            e.to_string(),
            "registry \"mirror\" is beyond the tenant's ceiling"
        );
        let e = Policy::combine(&ceiling, &parts(&["nope"], &[], &[]), &known()).unwrap_err();
        assert!(matches!(e, PolicyError::RegistryUnknown { .. }), "{e}");
        assert!(e.to_string().contains("not configured"), "{e}");
    }

    #[test]
    fn both_allowlists_must_match_and_any_deny_wins() {
        let ceiling = parts(&[], &["req*", "numpy"], &["evil*"]);
        let asked = parts(&[], &["requests"], &["numpy"]);
        let p = Policy::combine(&ceiling, &asked, &known()).unwrap();
        assert!(p.package("pypi", true, "requests").is_ok());
        // On the ceiling's list, not on the sandbox's.
        assert_eq!(
            p.package("pypi", true, "req-extra"),
            Err(Refusal::NotAllowed {
                package: "req-extra".into(),
                source: Source::Sandbox
            })
        );
        let denied = p.package("pypi", true, "evil-pkg").unwrap_err();
        assert_eq!(
            denied.to_string(),
            "package evil-pkg is denied by \"evil*\" in the tenant's ceiling"
        );
        assert!(matches!(
            p.package("pypi", true, "numpy"),
            Err(Refusal::Denied {
                source: Source::Sandbox,
                ..
            })
        ));
    }

    #[test]
    fn offline_from_either_side_refuses_everything_first() {
        let asked = Parts {
            offline: true,
            ..Default::default()
        };
        let p = Policy::combine(&Parts::default(), &asked, &known()).unwrap();
        let r = p.package("pypi", true, "requests").unwrap_err();
        assert_eq!(r, Refusal::Offline(Source::Sandbox));
        assert!(r.to_string().contains("offline"));
        let ceiling = Parts {
            offline: true,
            ..Default::default()
        };
        let p = Policy::combine(&ceiling, &Parts::default(), &known()).unwrap();
        assert_eq!(p.registry("npm"), Err(Refusal::Offline(Source::Tenant)));
        assert!(p.to_parts().offline);
    }

    #[test]
    fn the_smaller_cap_holds() {
        let c = |n| Parts {
            max_download_bytes: n,
            ..Default::default()
        };
        let k = known();
        assert_eq!(
            Policy::combine(&c(100), &c(0), &k)
                .unwrap()
                .max_download_bytes,
            100
        );
        assert_eq!(
            Policy::combine(&c(0), &c(50), &k)
                .unwrap()
                .max_download_bytes,
            50
        );
        assert_eq!(
            Policy::combine(&c(100), &c(500), &k)
                .unwrap()
                .max_download_bytes,
            100
        );
    }

    #[test]
    fn bad_patterns_fail_the_combination() {
        let e = Policy::combine(&Parts::default(), &parts(&[], &["a b"], &[]), &known());
        assert!(matches!(e, Err(PolicyError::Pattern(_))), "{e:?}");
    }
}
