//! `volume create`, `volume ls`, `volume rm`.

use airlock_api::v1::{CreateVolumeRequest, DeleteVolumeRequest, ListVolumesRequest};
use serde_json::{Value, json};

use super::{Ctx, fail};
use crate::args::VolumeCommand;
use crate::output::{print_json, volume_json, volume_table};

/// Runs a `volume` command.
pub async fn run(ctx: &mut Ctx, command: VolumeCommand) -> Result<u8, String> {
    match command {
        VolumeCommand::Create(a) => {
            let req = CreateVolumeRequest {
                name: a.name,
                size_mib: a.size_mib,
            };
            let v = ctx
                .client
                .create_volume(req)
                .await
                .map_err(fail)?
                .into_inner();
            if ctx.json {
                print_json(&volume_json(&v));
            } else {
                println!("{}", v.name);
            }
            Ok(0)
        }
        VolumeCommand::Ls => {
            let r = ctx
                .client
                .list_volumes(ListVolumesRequest {})
                .await
                .map_err(fail)?
                .into_inner();
            if ctx.json {
                print_json(&Value::Array(r.volumes.iter().map(volume_json).collect()));
            } else {
                print!("{}", volume_table(&r.volumes));
            }
            Ok(0)
        }
        VolumeCommand::Rm(a) => {
            let req = DeleteVolumeRequest {
                name: a.name.clone(),
            };
            let deleted = ctx
                .client
                .delete_volume(req)
                .await
                .map_err(fail)?
                .into_inner()
                .deleted;
            if ctx.json {
                print_json(&json!({"name": a.name, "deleted": deleted}));
            }
            Ok(0)
        }
    }
}
