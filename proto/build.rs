//! Generates the protocol types from `agent.proto` with prost-build (needs `protoc`).

use std::path::{Path, PathBuf};

const PROTO: &str = "agent.proto";

/// `$PROTOC` if set, else the first `protoc` on `$PATH`.
fn find_protoc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PROTOC") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("protoc"))
        .find(|candidate| candidate.is_file())
}

fn main() {
    println!("cargo:rerun-if-changed={PROTO}");
    println!("cargo:rerun-if-env-changed=PROTOC");
    let Some(protoc) = find_protoc() else {
        panic!(
            "airlock-proto needs the protobuf compiler `protoc` to build {PROTO}, and none was \
             found (neither $PROTOC nor `protoc` on $PATH): install it with \
             `apt-get install protobuf-compiler`"
        );
    };
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    if let Err(e) = config.compile_protos(&[Path::new(PROTO)], &[Path::new(".")]) {
        panic!("compiling {PROTO} with {}: {e}", protoc.display());
    }
}
