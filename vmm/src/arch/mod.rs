//! x86_64 specifics: memory layout, boot structures, CPUID, MP table, vCPU register setup.

pub mod boot;
pub mod cpuid;
pub mod layout;
pub mod mptable;
pub mod pagewalk;
pub mod regs;
