//! envd's Connect RPC interface (`proto/e2b`: `process.Process`, `filesystem.Filesystem`) as
//! buffa messages and connectrpc service traits, for the E2B gateway.

fn main() {
    println!("cargo:rerun-if-changed=../proto/e2b");
    if let Err(e) = connectrpc_build::Config::new()
        .files(&[
            "../proto/e2b/process.proto",
            "../proto/e2b/filesystem.proto",
        ])
        .includes(&["../proto/e2b/"])
        .include_file("_connectrpc.rs")
        .compile()
    {
        panic!("generating envd's interface from proto/e2b (needs protoc): {e}");
    }
}
