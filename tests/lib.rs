//! Shared helpers for the system tests.
