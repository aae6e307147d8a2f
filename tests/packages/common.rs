//! What the package tests (`packages.rs`, `npm.rs`) share: their sandboxes on the shared
//! daemon with the registries configured, the install log, and how the proxy is reached.
#![allow(dead_code)] // each test file uses its part

use airlock_api::v1::{
    CreateSandboxRequest, FileToPlace, GetInstallLogRequest, InstallEvent, PackagePolicy, Sandbox,
};
use airlock_system_tests::harness::Client;
use airlock_system_tests::shared::{Shared, scenario};

use crate::offregistry::off_registry;
use crate::registries::registries;

/// The package proxy where the guest's pip and npm reach it (its gateway address).
pub const PROXY: &str = "http://100.96.0.1:3141";
/// How the base image's npm introduces itself, and what it accepts for a packument.
pub const NPM_UA: &str = "npm/10.9.2 node/v22.12.0 linux x64 workspaces/false";
pub const NPM_ACCEPT: &str =
    "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8, */*";

/// A sandbox with the package policy `packages` (and `files`) on the shared daemon, whose
/// registries are this process's (and the one whose links lead off it, `offregistry`), and the
/// lock of its scenario.
pub async fn start(
    packages: PackagePolicy,
    files: Vec<FileToPlace>,
) -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    Client,
    Sandbox,
) {
    let r = registries();
    let config = format!("{}{}", r.config(), off_registry().config());
    let (serial, s) = scenario(&config).await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            packages: Some(packages),
            files,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    (serial, s, c, sb)
}

/// The sandbox's install log.
pub async fn log_of(c: &mut Client, id: &str) -> Vec<InstallEvent> {
    c.get_install_log(GetInstallLogRequest {
        sandbox_id: id.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .events
}

/// A policy allowing and denying these names.
pub fn policy(allow: &[&str], deny: &[&str]) -> PackagePolicy {
    PackagePolicy {
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub async fn destroy(c: &mut Client, id: &str) {
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap();
}
