//! `template create`, `build`, `rebuild`, `ls`, `log`, `rm`.

use airlock_api::v1::{
    DeleteTemplateRequest, GetTemplateLogRequest, GetTemplateSbomRequest, ListTemplatesRequest,
    RebuildTemplateRequest, Template, TemplateEvent,
};
use serde_json::{Value, json};

use super::{Ctx, fail};
use crate::args::{
    TemplateBuildArgs, TemplateCommand, TemplateCreateArgs, TemplateRebuildArgs, TemplateSbomArgs,
};
use crate::output::{print_json, template_json, template_table};
use crate::request::{build_request, template_request};

/// Runs a `template` command.
pub async fn run(ctx: &mut Ctx, command: TemplateCommand) -> Result<u8, String> {
    match command {
        TemplateCommand::Create(a) => create(ctx, &a).await,
        TemplateCommand::Build(a) => build(ctx, &a).await,
        TemplateCommand::Ls => list(ctx).await,
        TemplateCommand::Rm(a) => remove(ctx, &a.name).await,
        TemplateCommand::Log(a) => log(ctx, &a.name).await,
        TemplateCommand::Sbom(a) => sbom(ctx, a).await,
        TemplateCommand::Rebuild(a) => rebuild(ctx, a).await,
    }
}

fn print_template(ctx: &Ctx, t: &Template) {
    if ctx.json {
        print_json(&template_json(t));
    } else {
        let shown = match t.tag.as_str() {
            "" | "latest" => t.name.clone(),
            tag => format!("{}:{tag}", t.name),
        };
        println!("{shown} ({})", t.id);
    }
}

/// Prints a build's progress on stderr (a RUN's output as it comes, unadorned) and the
/// finished template on stdout.
async fn follow(ctx: &Ctx, mut stream: tonic::Streaming<TemplateEvent>) -> Result<u8, String> {
    while let Some(ev) = stream.message().await.map_err(fail)? {
        if ev.phase == "output" {
            eprint!("{}", ev.message);
        } else {
            eprintln!(
                "[{:>6.1} s] {}: {}",
                ev.elapsed_ms as f64 / 1000.0,
                ev.phase,
                ev.message
            );
        }
        if let Some(t) = ev.template {
            print_template(ctx, &t);
        }
    }
    Ok(0)
}

/// `template create`: the build's progress on stderr, the template on stdout.
async fn create(ctx: &mut Ctx, args: &TemplateCreateArgs) -> Result<u8, String> {
    let password = if args.registry_password_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| format!("reading the registry password from stdin: {e}"))?;
        line.trim_end_matches(['\r', '\n']).to_owned()
    } else {
        std::env::var("AIRLOCK_REGISTRY_PASSWORD").unwrap_or_default()
    };
    let stream = ctx
        .client
        .create_template(template_request(args, password))
        .await
        .map_err(fail)?
        .into_inner();
    follow(ctx, stream).await
}

/// `template build`: steps and RUN output on stderr, the template on stdout.
async fn build(ctx: &mut Ctx, args: &TemplateBuildArgs) -> Result<u8, String> {
    let password = std::env::var("AIRLOCK_REGISTRY_PASSWORD").unwrap_or_default();
    let req = build_request(args, password)?;
    let stream = ctx
        .client
        .build_template(req)
        .await
        .map_err(fail)?
        .into_inner();
    follow(ctx, stream).await
}

/// `template rebuild`: as `build`.
async fn rebuild(ctx: &mut Ctx, args: TemplateRebuildArgs) -> Result<u8, String> {
    let req = RebuildTemplateRequest {
        name: args.name,
        tag: args.tag.unwrap_or_default(),
        registry_username: args.registry_user.unwrap_or_default(),
        registry_password: std::env::var("AIRLOCK_REGISTRY_PASSWORD").unwrap_or_default(),
    };
    let stream = ctx
        .client
        .rebuild_template(req)
        .await
        .map_err(fail)?
        .into_inner();
    follow(ctx, stream).await
}

/// `template sbom`: the document (or, with --packages, a line per package).
async fn sbom(ctx: &mut Ctx, args: TemplateSbomArgs) -> Result<u8, String> {
    let r = ctx
        .client
        .get_template_sbom(GetTemplateSbomRequest {
            name: args.name,
            format: args.format,
        })
        .await
        .map_err(fail)?
        .into_inner();
    if args.packages {
        for p in &r.packages {
            println!("{} {} {}", p.ecosystem, p.name, p.version);
        }
    } else {
        println!("{}", r.document);
    }
    Ok(0)
}

/// `template log`: the kept log as it was streamed (--json: `{log, truncated}`).
async fn log(ctx: &mut Ctx, name: &str) -> Result<u8, String> {
    let r = ctx
        .client
        .get_template_log(GetTemplateLogRequest {
            name: name.to_owned(),
        })
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&json!({"name": name, "log": r.log, "truncated": r.truncated}));
    } else {
        if r.truncated {
            eprintln!("(earlier lines dropped: the log keeps its last MiB)");
        }
        print!("{}", r.log);
    }
    Ok(0)
}

/// `template ls`: a table, or a list of records.
async fn list(ctx: &mut Ctx) -> Result<u8, String> {
    let r = ctx
        .client
        .list_templates(ListTemplatesRequest {})
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&Value::Array(
            r.templates.iter().map(template_json).collect(),
        ));
    } else {
        print!("{}", template_table(&r.templates));
    }
    Ok(0)
}

/// `template rm`: text mode prints nothing.
async fn remove(ctx: &mut Ctx, name: &str) -> Result<u8, String> {
    let req = DeleteTemplateRequest {
        name: name.to_owned(),
    };
    ctx.client.delete_template(req).await.map_err(fail)?;
    if ctx.json {
        print_json(&json!({"name": name, "deleted": true}));
    }
    Ok(0)
}
