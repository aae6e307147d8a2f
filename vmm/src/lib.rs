//! Airlock VMM library.
