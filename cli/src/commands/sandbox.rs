//! `create`, `ls`, `get`, `pause`, `resume`, `snapshot`, `rm`, `usage`.

use airlock_api::v1::{
    DestroySandboxRequest, GetSandboxRequest, GetUsageRequest, PauseSandboxRequest,
    ResumeSandboxRequest, Sandbox, SnapshotSandboxRequest,
};
use serde_json::{Value, json};

use super::{Ctx, fail};
use crate::args::{CreateArgs, LsArgs, SnapshotArgs};
use crate::output::{print_json, sandbox_json, sandbox_table, sandbox_text, template_json};
use crate::request::{create_request, list_request, read_local};

/// `create`: prints the id (and the timing on stderr), or the record.
pub async fn create(ctx: &mut Ctx, args: &CreateArgs) -> Result<u8, String> {
    let req = create_request(args, &read_local)?;
    let s = ctx
        .client
        .create_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&sandbox_json(&s));
    } else {
        println!("{}", s.id);
        eprintln!(
            "ready in {:.1} ms (host {:.1} ms, guest {:.1} ms, restore {:.2} ms)",
            s.create_ms, s.create_host_ms, s.create_guest_ms, s.restore_ms
        );
    }
    Ok(0)
}

/// `ls`: a table, or a list of records.
pub async fn list(ctx: &mut Ctx, args: &LsArgs) -> Result<u8, String> {
    let r = ctx
        .client
        .list_sandboxes(list_request(args))
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&Value::Array(
            r.sandboxes.iter().map(sandbox_json).collect(),
        ));
    } else {
        print!("{}", sandbox_table(&r.sandboxes));
    }
    Ok(0)
}

/// `get`: one sandbox.
pub async fn get(ctx: &mut Ctx, id: &str) -> Result<u8, String> {
    let req = GetSandboxRequest {
        sandbox_id: id.to_owned(),
    };
    let s = ctx
        .client
        .get_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&sandbox_json(&s));
    } else {
        print!("{}", sandbox_text(&s));
    }
    Ok(0)
}

/// Prints the record a `pause` or `resume` answered, in JSON mode (text: nothing, as ever).
fn quiet_record(ctx: &Ctx, s: &Sandbox) -> u8 {
    if ctx.json {
        print_json(&sandbox_json(s));
    }
    0
}

/// `pause`.
pub async fn pause(ctx: &mut Ctx, id: &str) -> Result<u8, String> {
    let req = PauseSandboxRequest {
        sandbox_id: id.to_owned(),
    };
    let s = ctx
        .client
        .pause_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    Ok(quiet_record(ctx, &s))
}

/// `resume`.
pub async fn resume(ctx: &mut Ctx, id: &str) -> Result<u8, String> {
    let req = ResumeSandboxRequest {
        sandbox_id: id.to_owned(),
    };
    let s = ctx
        .client
        .resume_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    Ok(quiet_record(ctx, &s))
}

/// `snapshot`: prints the new template.
pub async fn snapshot(ctx: &mut Ctx, args: &SnapshotArgs) -> Result<u8, String> {
    let req = SnapshotSandboxRequest {
        sandbox_id: args.id.clone(),
        template_name: args.template.clone(),
        shared: args.shared,
    };
    let t = ctx
        .client
        .snapshot_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&template_json(&t));
    } else {
        println!("{} ({})", t.name, t.id);
    }
    Ok(0)
}

/// `rm`: text mode prints nothing.
pub async fn destroy(ctx: &mut Ctx, id: &str) -> Result<u8, String> {
    let req = DestroySandboxRequest {
        sandbox_id: id.to_owned(),
    };
    let r = ctx
        .client
        .destroy_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&json!({"id": id, "destroyed": r.destroyed}));
    }
    Ok(0)
}

/// `usage`: what the tenant holds against its quota (0: no limit beyond the host's).
pub async fn usage(ctx: &mut Ctx) -> Result<u8, String> {
    let u = ctx
        .client
        .get_usage(GetUsageRequest {})
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&json!({
            "tenant": u.tenant,
            "live_sandboxes": u.live_sandboxes, "max_sandboxes": u.max_sandboxes,
            "memory_mib": u.memory_mib, "max_memory_mib": u.max_memory_mib,
            "templates": u.templates, "max_templates": u.max_templates,
            "template_mib": u.template_mib, "max_template_mib": u.max_template_mib,
            "output_bytes": u.output_bytes, "max_output_mib": u.max_output_mib,
            "sandbox_records": u.sandbox_records, "execution_records": u.execution_records,
            "record_retention_s": u.record_retention_s, "output_retention_s": u.output_retention_s,
        }));
        return Ok(0);
    }
    println!("tenant {}", u.tenant);
    println!("sandboxes      {} of {}", u.live_sandboxes, u.max_sandboxes);
    println!(
        "memory         {} of {} MiB",
        u.memory_mib, u.max_memory_mib
    );
    println!(
        "templates      {} of {} ({} of {} MiB)",
        u.templates, u.max_templates, u.template_mib, u.max_template_mib
    );
    println!(
        "output stored  {} bytes of {} MiB",
        u.output_bytes, u.max_output_mib
    );
    println!(
        "records        {} sandboxes, {} executions",
        u.sandbox_records, u.execution_records
    );
    println!(
        "kept           records {} s after a sandbox ends, output {} s",
        u.record_retention_s, u.output_retention_s
    );
    Ok(0)
}
