//! The compute commands of the `lockstep` CLI: dataflows, inputs, peeks and
//! subscribes against a running environment.

use anyhow::Context;
use clap::Subcommand;
use futures::StreamExt;
use lockstep_api::proto;
use lockstep_plan::text::parse_plan;
use lockstep_protocol::proto as wire;

/// Dataflow commands.
#[derive(Subcommand)]
pub enum DataflowCommand {
    /// Create a dataflow on a replica.
    Create {
        /// The replica's name.
        #[arg(long)]
        replica: String,
        /// A name for logs.
        #[arg(long, default_value = "")]
        name: String,
        /// An input collection the plans read (repeat for several).
        #[arg(long = "input", required = true)]
        inputs: Vec<u64>,
        /// An export as `COLLECTION_ID=PLAN`, e.g.
        /// `101=reduce(get(1), [#0], count, sum(#1))` (repeat for several).
        #[arg(long = "export", required = true)]
        exports: Vec<String>,
    },
    /// Drop a dataflow.
    Drop {
        /// Its ID.
        id: u64,
    },
    /// List dataflows.
    ///
    /// `-o json`: `{"dataflows": [{"id", "replica", "name", "as_of",
    /// "inputs": [ID], "exports": [{"collection_id", "plan"}]}]}`, each plan
    /// in the syntax `--export` takes.
    List {
        #[command(flatten)]
        output: crate::output::OutputArg,
    },
}

/// Parses `ROW@TIME[:DIFF]`, e.g. `1,10@0` or `1,10@2:-1`.
pub fn parse_update(s: &str) -> anyhow::Result<wire::Update> {
    let (row, rest) = s
        .split_once('@')
        .with_context(|| format!("update {s:?}: expected ROW@TIME[:DIFF], e.g. 1,10@0:1"))?;
    let (time, diff) = match rest.split_once(':') {
        Some((t, d)) => (
            t,
            d.parse()
                .with_context(|| format!("update {s:?}: bad diff"))?,
        ),
        None => (rest, 1),
    };
    let values: Vec<i64> = if row.is_empty() {
        vec![]
    } else {
        row.split(',')
            .map(|v| v.trim().parse::<i64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("update {s:?}: a row is comma-separated integers"))?
    };
    Ok(wire::Update {
        row: lockstep_plan::row(&values),
        time: time
            .parse()
            .with_context(|| format!("update {s:?}: bad time"))?,
        diff,
    })
}

pub(crate) fn status_err(s: tonic::Status) -> anyhow::Error {
    // An answer over this client's decoding limit fails here, in tonic, as
    // OUT_OF_RANGE, which the API uses for reads below a since: say what it
    // is (the environment itself refuses a larger answer with
    // RESOURCE_EXHAUSTED before sending it).
    if s.code() == tonic::Code::OutOfRange && s.message().contains("message length too large") {
        return anyhow::anyhow!(
            "{}: the answer is larger than this client's limit of {} bytes: {}",
            tonic::Code::ResourceExhausted,
            lockstep_api::MAX_ANSWER_BYTES,
            s.message()
        );
    }
    anyhow::anyhow!("{}: {}", s.code(), s.message())
}

/// A row as the CLI prints it: a row of the built-in family as its
/// comma-separated integers, any other row as `0x` and its bytes in hex.
pub fn show_row(row: &[u8]) -> String {
    match lockstep_plan::rows::decode(row) {
        Ok(values) => values
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => std::iter::once("0x".to_string())
            .chain(row.iter().map(|b| format!("{b:02x}")))
            .collect(),
    }
}

fn show_rows(rows: &[wire::Row]) {
    for r in rows {
        println!("{}\t{}", show_row(&r.values), r.diff);
    }
}

/// Runs a dataflow command.
pub async fn dataflow(client: &mut crate::Client, command: DataflowCommand) -> anyhow::Result<()> {
    match command {
        DataflowCommand::Create {
            replica,
            name,
            inputs,
            exports,
        } => {
            let exports = exports
                .iter()
                .map(|e| {
                    let (id, plan) = e
                        .split_once('=')
                        .with_context(|| format!("export {e:?}: expected COLLECTION_ID=PLAN"))?;
                    let collection_id = id
                        .trim()
                        .parse()
                        .with_context(|| format!("export {e:?}: bad collection ID"))?;
                    let plan = parse_plan(plan.trim()).with_context(|| format!("export {e:?}"))?;
                    Ok(wire::Export {
                        collection_id,
                        description: lockstep_plan::encode(&plan),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let r = client
                .create_dataflow(proto::CreateDataflowRequest {
                    replica,
                    name,
                    inputs,
                    exports,
                    as_of: 0,
                    format: String::new(),
                })
                .await
                .map_err(status_err)?
                .into_inner();
            if let Some(d) = r.dataflow {
                println!("created dataflow {}", d.id);
            }
        }
        DataflowCommand::Drop { id } => {
            client
                .drop_dataflow(proto::DropDataflowRequest { id })
                .await
                .map_err(status_err)?;
            println!("dropped dataflow {id}");
        }
        DataflowCommand::List { output } => {
            let mut entries = Vec::new();
            let mut page_token = String::new();
            loop {
                let page = client
                    .list_dataflows(proto::ListDataflowsRequest {
                        page_size: 1000,
                        page_token,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                entries.extend(page.dataflows);
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
            let mut dataflows = Vec::new();
            for e in entries {
                let Some(d) = e.dataflow else { continue };
                dataflows.push((
                    e.replica,
                    lockstep_protocol::DataflowDescription::try_from(d)?,
                ));
            }
            if output.json() {
                let dataflows: Vec<serde_json::Value> = dataflows
                    .iter()
                    .map(|(replica, d)| {
                        let exports: Vec<serde_json::Value> = d
                            .exports
                            .iter()
                            .map(|x| {
                                serde_json::json!({
                                    "collection_id": x.collection_id,
                                    "plan": lockstep_plan::display(x),
                                })
                            })
                            .collect();
                        serde_json::json!({
                            "id": d.id,
                            "replica": replica,
                            "name": d.debug_name,
                            "as_of": d.as_of,
                            "inputs": d.inputs,
                            "exports": exports,
                        })
                    })
                    .collect();
                return crate::output::print_json(&serde_json::json!({ "dataflows": dataflows }));
            }
            use crate::output::{Align, Table};
            let mut table = Table::new(&[
                ("ID", Align::Right),
                ("REPLICA", Align::Left),
                ("NAME", Align::Left),
                ("EXPORTS", Align::Left),
            ]);
            for (replica, d) in &dataflows {
                let exports: Vec<String> = d
                    .exports
                    .iter()
                    .map(|x| format!("{}={}", x.collection_id, lockstep_plan::display(x)))
                    .collect();
                table.row(vec![
                    d.id.to_string(),
                    replica.clone(),
                    d.debug_name.clone(),
                    exports.join("  "),
                ]);
            }
            table.print();
        }
    }
    Ok(())
}

/// Writes updates to an input collection.
pub async fn write_input(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    updates: Vec<String>,
    upper: u64,
) -> anyhow::Result<()> {
    let updates = updates
        .iter()
        .map(|u| parse_update(u))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let n = updates.len();
    client
        .write_input(proto::WriteInputRequest {
            replica,
            collection_id,
            updates,
            upper,
        })
        .await
        .map_err(status_err)?;
    println!("wrote {n} updates to collection {collection_id}; upper {upper}");
    Ok(())
}

/// Peeks a collection and prints `row<TAB>count` lines.
pub async fn peek(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    timestamp: u64,
) -> anyhow::Result<()> {
    let r = client
        .peek(proto::PeekRequest {
            replica,
            collection_id,
            timestamp,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    show_rows(&r.rows);
    Ok(())
}

/// Subscribes and prints `time<TAB>row<TAB>diff` lines until `until` (or forever).
pub async fn subscribe(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    as_of: u64,
    until: Option<u64>,
) -> anyhow::Result<()> {
    let mut stream = client
        .subscribe(proto::SubscribeRequest {
            replica,
            collection_id,
            as_of,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(status_err)?;
        for u in &batch.updates {
            println!("{}\t{}\t{}", u.time, show_row(&u.row), u.diff);
        }
        match batch.upper.first() {
            None => break,
            Some(&upper) if until.is_some_and(|t| upper > t) => break,
            _ => {}
        }
    }
    Ok(())
}
