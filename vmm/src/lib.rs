//! Airlock's VMM: one KVM microVM per process, on the rust-vmm crates.
//!
//! Synchronous by design (no async runtime): one event-loop thread ([`vmm::Vmm::run`]) and one
//! thread per vCPU ([`vcpu`]). The boot recipe is [`builder::build_microvm_for_boot`].

pub mod arch;
pub mod build_error;
pub mod builder;
pub mod config;
pub mod control;
pub mod devices;
pub mod exit;
pub mod kick;
pub mod logger;
pub mod memstat;
pub mod probe;
pub mod profile;
pub mod seccomp;
pub mod settle;
pub mod snapshot;
pub mod vcpu;
pub mod vm;
pub mod vmm;

pub use builder::{
    BuildError, RestoreConfig, build_microvm_for_boot, build_microvm_from_snapshot, restore_microvm,
};
pub use config::VmConfig;
pub use exit::VmExit;
pub use vmm::Vmm;
