//! `nodes`: the daemon's nodes (in cluster mode every node of the cluster).

use airlock_api::v1::ListNodesRequest;

use super::{Ctx, fail};
use crate::output::{node_json, node_table, print_json};

/// Lists the nodes.
pub async fn list(ctx: &mut Ctx) -> Result<u8, String> {
    let nodes = ctx
        .client
        .list_nodes(ListNodesRequest {})
        .await
        .map_err(fail)?
        .into_inner()
        .nodes;
    if ctx.json {
        print_json(&serde_json::Value::Array(
            nodes.iter().map(node_json).collect(),
        ));
    } else {
        print!("{}", node_table(&nodes));
    }
    Ok(0)
}
