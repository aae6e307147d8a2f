//! Every RPC of `airlock.v1.Airlock`, described once: which token may call it, what of the
//! tenant's it reaches, whether repeating it is safe, what the audit trail records of it, and
//! where cluster mode sends it. The service authorizes by it ([`Right`]) and names its calls by
//! it (logs, denials in the audit trail), and the cluster's router routes by it
//! ([`Routing`]). A test fails when the proto has an RPC this table lacks, or the table one the
//! proto lacks.

use crate::audit::Kind;

/// Which of a tenant's tokens may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Right {
    /// Any (`tokens` and `run_tokens`).
    Run,
    /// Only a token that may make and delete templates (not a `run_tokens` one).
    MakeTemplates,
}

/// What of the tenant's the call reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only the caller's own sandboxes, executions, volumes, records and events.
    Own,
    /// The caller's own templates and the shared ones (the operator's, made as the default
    /// tenant).
    OwnAndShared,
    /// The node (or the cluster) as a whole; an operator sees more of it.
    Node,
}

/// Whether a client may repeat the call when its answer was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idempotency {
    /// It changes nothing.
    ReadOnly,
    /// A repeat leaves the same state (it may answer NOT_FOUND or the state reached).
    Repeatable,
    /// A repeat does it again (another sandbox, another execution, ...).
    Once,
}

/// Where cluster mode sends the call (a call forwarded by another node is always served where
/// it arrives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// To the node holding the sandbox named by field 1 of the request.
    BySandbox,
    /// To the node holding the execution named by field 1 of the request.
    ByExecution,
    /// To the node holding the sandbox named by field 1 of the first message's header
    /// (WriteFile's stream).
    ByWriteFileHeader,
    /// Placed by the template and the nodes' room (CreateSandbox).
    Place,
    /// To every node, the answers merged into one list.
    Gather,
    /// To every node holding it; done when one did.
    EveryHolder,
    /// Served by the node it arrives at.
    Local,
}

/// One RPC's descriptor.
#[derive(Clone, Copy, Debug)]
pub struct Rpc {
    /// The method's name in the proto.
    pub name: &'static str,
    pub right: Right,
    // `scope`, `idempotency` and `audit` are described for clients and reviewers (docs/api.md
    // is written from this table); no decision of the daemon's reads them yet.
    #[cfg_attr(not(test), allow(dead_code))]
    pub scope: Scope,
    #[cfg_attr(not(test), allow(dead_code))]
    pub idempotency: Idempotency,
    pub routing: Routing,
    /// The events the call records when it succeeds (any call may record a `denial`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub audit: &'static [Kind],
}

macro_rules! rpcs {
    ($($konst:ident $name:literal: $right:ident $scope:ident $idem:ident $routing:ident
        [$($audit:ident),*];)*) => {
        $(
            pub const $konst: Rpc = Rpc {
                name: $name,
                right: Right::$right,
                scope: Scope::$scope,
                idempotency: Idempotency::$idem,
                routing: Routing::$routing,
                audit: &[$(Kind::$audit),*],
            };
        )*
        /// Every RPC, in the proto's order.
        pub const ALL: &[&Rpc] = &[$(&$konst),*];
    };
}

rpcs! {
    CREATE_TEMPLATE "CreateTemplate": MakeTemplates Own Once Local [];
    BUILD_TEMPLATE "BuildTemplate": MakeTemplates OwnAndShared Once Local [];
    LIST_TEMPLATES "ListTemplates": Run OwnAndShared ReadOnly Gather [];
    DELETE_TEMPLATE "DeleteTemplate": MakeTemplates Own Repeatable EveryHolder [];
    GET_TEMPLATE_LOG "GetTemplateLog": Run OwnAndShared ReadOnly Local [];
    REBUILD_TEMPLATE "RebuildTemplate": MakeTemplates OwnAndShared Once Local [];
    GET_TEMPLATE_SBOM "GetTemplateSbom": Run OwnAndShared ReadOnly Local [];
    CREATE_SANDBOX "CreateSandbox": Run OwnAndShared Once Place [SandboxCreate, SecretUse];
    GET_SANDBOX "GetSandbox": Run Own ReadOnly BySandbox [];
    LIST_SANDBOXES "ListSandboxes": Run Own ReadOnly Gather [];
    PAUSE_SANDBOX "PauseSandbox": Run Own Repeatable BySandbox [];
    RESUME_SANDBOX "ResumeSandbox": Run Own Repeatable BySandbox [];
    SNAPSHOT_SANDBOX "SnapshotSandbox": MakeTemplates Own Once BySandbox [];
    DESTROY_SANDBOX "DestroySandbox": Run Own Repeatable BySandbox [SandboxEnd];
    EXEC "Exec": Run Own Once BySandbox [ExecStart, ExecEnd, SecretUse];
    STREAM_EXECUTION "StreamExecution": Run Own ReadOnly ByExecution [];
    GET_EXECUTION "GetExecution": Run Own ReadOnly ByExecution [];
    KILL_EXECUTION "KillExecution": Run Own Repeatable ByExecution [];
    WRITE_STDIN "WriteStdin": Run Own Once ByExecution [];
    WRITE_FILE "WriteFile": Run Own Repeatable ByWriteFileHeader [FileWrite];
    READ_FILE "ReadFile": Run Own ReadOnly BySandbox [FileRead];
    LIST_FILES "ListFiles": Run Own ReadOnly BySandbox [];
    STAT_FILE "StatFile": Run Own ReadOnly BySandbox [];
    MAKE_DIR "MakeDir": Run Own Repeatable BySandbox [];
    REMOVE_FILE "RemoveFile": Run Own Repeatable BySandbox [];
    RENAME_FILE "RenameFile": Run Own Once BySandbox [];
    SET_NETWORK_POLICY "SetNetworkPolicy": Run Own Repeatable BySandbox [];
    GET_EGRESS_LOG "GetEgressLog": Run Own ReadOnly BySandbox [];
    EXPOSE_PORT "ExposePort": Run Own Once BySandbox [];
    GET_INSTALL_LOG "GetInstallLog": Run Own ReadOnly BySandbox [];
    REMOVE_SECRETS "RemoveSecrets": Run Own Repeatable BySandbox [SecretRemove];
    LIST_AUDIT_EVENTS "ListAuditEvents": Run Own ReadOnly Local [];
    CREATE_VOLUME "CreateVolume": Run Own Once Local [];
    LIST_VOLUMES "ListVolumes": Run Own ReadOnly Local [];
    DELETE_VOLUME "DeleteVolume": Run Own Repeatable Local [];
    GET_USAGE "GetUsage": Run Own ReadOnly Local [];
    RUN_CODE "RunCode": Run Own Once BySandbox [CodeRun];
    CREATE_CODE_CONTEXT "CreateCodeContext": Run Own Once BySandbox [];
    LIST_CODE_CONTEXTS "ListCodeContexts": Run Own ReadOnly BySandbox [];
    RESTART_CODE_CONTEXT "RestartCodeContext": Run Own Repeatable BySandbox [];
    REMOVE_CODE_CONTEXT "RemoveCodeContext": Run Own Repeatable BySandbox [];
    LIST_NODES "ListNodes": Run Node ReadOnly Local [];
}

/// The table as docs/api.md shows it (Markdown).
#[cfg(test)]
fn table() -> String {
    let mut out = String::from(
        "| RPC | token | reaches | repeated | cluster mode | audit events |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in ALL {
        let right = match r.right {
            Right::Run => "any",
            Right::MakeTemplates => "template maker",
        };
        let scope = match r.scope {
            Scope::Own => "own",
            Scope::OwnAndShared => "own and shared",
            Scope::Node => "the node",
        };
        let idempotency = match r.idempotency {
            Idempotency::ReadOnly => "read-only",
            Idempotency::Repeatable => "safe",
            Idempotency::Once => "does it again",
        };
        let routing = match r.routing {
            Routing::BySandbox => "to the sandbox's node",
            Routing::ByExecution => "to the execution's node",
            Routing::ByWriteFileHeader => "to the sandbox's node (header)",
            Routing::Place => "placed",
            Routing::Gather => "every node, merged",
            Routing::EveryHolder => "every node holding it",
            Routing::Local => "the node called",
        };
        let audit: Vec<String> = r
            .audit
            .iter()
            .map(|k| format!("`{}`", k.as_str()))
            .collect();
        out.push_str(&format!(
            "| {} | {right} | {scope} | {idempotency} | {routing} | {} |\n",
            r.name,
            audit.join(", ")
        ));
    }
    out
}

/// The RPC a method name (the last segment of the call's path) names.
pub fn by_name(method: &str) -> Option<&'static Rpc> {
    ALL.iter().copied().find(|r| r.name == method)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use prost::Message;

    use super::*;

    use prost_types::{DescriptorProto, FileDescriptorProto, MethodDescriptorProto};

    fn api() -> FileDescriptorProto {
        let set = prost_types::FileDescriptorSet::decode(airlock_api::FILE_DESCRIPTOR_SET).unwrap();
        set.file
            .into_iter()
            .find(|f| {
                f.package() == "airlock.v1" && f.service.iter().any(|s| s.name() == "Airlock")
            })
            .expect("airlock.v1.Airlock in the descriptor set")
    }

    /// The methods of `airlock.v1.Airlock`, as the compiled proto has them.
    fn methods(api: &FileDescriptorProto) -> Vec<MethodDescriptorProto> {
        let service = api.service.iter().find(|s| s.name() == "Airlock").unwrap();
        service.method.clone()
    }

    fn proto_methods() -> Vec<String> {
        methods(&api())
            .iter()
            .map(|m| m.name().to_owned())
            .collect()
    }

    /// The message `.airlock.v1.NAME`.
    fn message<'a>(api: &'a FileDescriptorProto, name: &str) -> &'a DescriptorProto {
        let name = name.trim_start_matches(".airlock.v1.");
        api.message_type
            .iter()
            .find(|m| m.name() == name)
            .unwrap_or_else(|| panic!("message {name}"))
    }

    /// Field 1 of `m`: its name and type name (`""` for a scalar).
    fn field_1(m: &DescriptorProto) -> (String, String, i32) {
        let f = m
            .field
            .iter()
            .find(|f| f.number() == 1)
            .unwrap_or_else(|| panic!("{} has no field 1", m.name()));
        (
            f.name().to_owned(),
            f.type_name().to_owned(),
            f.r#type.unwrap_or_default(),
        )
    }

    #[test]
    fn every_rpc_of_the_proto_has_one_descriptor_and_every_descriptor_an_rpc() {
        let proto = proto_methods();
        assert!(proto.len() >= 30, "{proto:?}");
        let table: Vec<String> = ALL.iter().map(|r| r.name.to_owned()).collect();
        let missing: Vec<_> = proto.iter().filter(|m| !table.contains(m)).collect();
        assert!(
            missing.is_empty(),
            "RPCs without a descriptor in rpc.rs: {missing:?}"
        );
        let stale: Vec<_> = table.iter().filter(|m| !proto.contains(m)).collect();
        assert!(stale.is_empty(), "descriptors of no RPC: {stale:?}");
        assert_eq!(table, proto, "one descriptor each, in the proto's order");
    }

    /// The router reads a sandbox's or an execution's id from field 1 of the request without
    /// knowing its type: every RPC routed so has it there, as a string of that name.
    #[test]
    fn every_call_routed_by_id_has_the_id_in_field_1() {
        use prost_types::field_descriptor_proto::Type;
        let api = api();
        for m in methods(&api) {
            let rpc = by_name(m.name()).unwrap();
            let want = match rpc.routing {
                Routing::BySandbox => "sandbox_id",
                Routing::ByExecution => "execution_id",
                Routing::ByWriteFileHeader => "header",
                _ => continue,
            };
            let input = message(&api, m.input_type());
            let (name, type_name, ty) = field_1(input);
            if rpc.routing == Routing::ByWriteFileHeader {
                assert_eq!(name, want, "{}", m.name());
                let header = message(&api, &type_name);
                assert_eq!(field_1(header).0, "sandbox_id", "{}", m.name());
                continue;
            }
            assert_eq!(
                (name.as_str(), ty),
                (want, Type::String as i32),
                "{}: field 1 of {}",
                m.name(),
                m.input_type()
            );
        }
    }

    #[test]
    fn the_descriptors_agree_with_themselves() {
        for r in ALL {
            // What changes nothing records nothing but a denial, and is no template maker's.
            if r.idempotency == Idempotency::ReadOnly {
                assert!(
                    r.audit.iter().all(|k| *k == Kind::FileRead),
                    "{}: a read records only what it read",
                    r.name
                );
                assert_eq!(r.right, Right::Run, "{}", r.name);
            }
            assert!(!r.audit.contains(&Kind::Denial), "{}: any call may", r.name);
        }
        assert_eq!(by_name("Exec").unwrap().routing, Routing::BySandbox);
        assert!(by_name("Nope").is_none());
    }

    const BEGIN: &str = "<!-- rpc table: written by daemon/src/rpc.rs (AIRLOCK_BLESS=1 cargo test -p \
                         airlockd rpc::) -->";
    const END: &str = "<!-- end of rpc table -->";

    /// docs/api.md shows this table as it is (`AIRLOCK_BLESS=1` writes it there).
    #[test]
    fn the_api_reference_shows_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/api.md");
        let text = std::fs::read_to_string(&path).unwrap();
        let block = format!("{BEGIN}\n{}{END}", table());
        let (Some(a), Some(b)) = (text.find(BEGIN), text.find(END)) else {
            panic!("docs/api.md has no rpc table; put this there:\n{block}");
        };
        let current = &text[a..b + END.len()];
        if current == block {
            return;
        }
        if std::env::var_os("AIRLOCK_BLESS").is_some() {
            std::fs::write(&path, text.replacen(current, &block, 1)).unwrap();
            return;
        }
        panic!("docs/api.md's table is not rpc.rs's (AIRLOCK_BLESS=1 writes it):\n{block}");
    }
}
