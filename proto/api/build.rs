//! Generates the `airlock.v1` types, client and server from `../airlock.proto` (needs `protoc`)
//! and a descriptor set for gRPC reflection.

use std::path::PathBuf;

const PROTO: &str = "../airlock.proto";

fn main() {
    println!("cargo:rerun-if-changed={PROTO}");
    println!("cargo:rerun-if-env-changed=PROTOC");
    if std::env::var_os("PROTOC").is_none() && !on_path("protoc") {
        panic!(
            "airlock-api needs the protobuf compiler `protoc` to build {PROTO}, and none was found \
             (neither $PROTOC nor `protoc` on $PATH): install it with \
             `apt-get install protobuf-compiler`"
        );
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Err(e) = tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("airlock_descriptor.bin"))
        .compile_protos(&[PROTO], &[".."])
    {
        panic!("compiling {PROTO}: {e}");
    }
}

fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}
