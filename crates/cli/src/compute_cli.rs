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
        /// `101=reduce(get(1), [#0], count, sum(#1))`, or as
        /// `COLLECTION_ID=0xHEX`: the description's bytes, for a family
        /// other than the built-in one (repeat for several).
        #[arg(long = "export", required = true)]
        exports: Vec<String>,
        /// The dataflow's format: the one the environment serves
        /// (`lockstep serve --format`) if not given.
        #[arg(long, default_value = "")]
        format: String,
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
    /// in the syntax `--export` takes (a description of another family as
    /// `0x` and its bytes in hex).
    List {
        #[command(flatten)]
        output: crate::output::OutputArg,
    },
}

/// Parses `0x` and an even number of hex digits into bytes.
fn parse_hex(s: &str) -> Option<Vec<u8>> {
    let digits = s.strip_prefix("0x")?;
    if digits.len() % 2 != 0 {
        return None;
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(digits.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Parses `ROW@TIME[:DIFF]`, e.g. `1,10@0` or `1,10@2:-1`; a row written
/// `0xHEX` is its bytes as they are (a row of another family).
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
    let row = if row.starts_with("0x") {
        parse_hex(row).with_context(|| {
            format!("update {s:?}: a row written 0x... is an even number of hex digits")
        })?
    } else if row.is_empty() {
        lockstep_plan::row(&[])
    } else {
        let values: Vec<i64> = row
            .split(',')
            .map(|v| v.trim().parse::<i64>())
            .collect::<Result<_, _>>()
            .with_context(|| {
                format!("update {s:?}: a row is comma-separated integers, or 0x and hex digits")
            })?;
        lockstep_plan::row(&values)
    };
    Ok(wire::Update {
        row,
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

/// `0x` and `bytes` in hex.
fn show_hex(bytes: &[u8]) -> String {
    std::iter::once("0x".to_string())
        .chain(bytes.iter().map(|b| format!("{b:02x}")))
        .collect()
}

/// A row as the CLI prints it: a row of the built-in family as its
/// comma-separated integers, any other row (or every row, if `hex`) as `0x`
/// and its bytes in hex.
pub fn show_row(row: &[u8], hex: bool) -> String {
    match lockstep_plan::rows::decode(row) {
        Ok(values) if !hex => values
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(","),
        _ => show_hex(row),
    }
}

/// An export's description as the CLI prints it: a plan in the syntax
/// `--export` takes, or `0x` and the bytes of another family's.
fn show_description(
    d: &lockstep_protocol::DataflowDescription,
    x: &lockstep_protocol::Export,
) -> String {
    if d.format == lockstep_plan::FORMAT {
        lockstep_plan::display(x)
    } else {
        show_hex(&x.description)
    }
}

fn show_rows(rows: &[wire::Row], hex: bool) {
    for r in rows {
        crate::output::line(format_args!("{}\t{}", show_row(&r.values, hex), r.diff));
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
            format,
        } => {
            let exports = exports
                .iter()
                .map(|e| {
                    let (id, plan) = e.split_once('=').with_context(|| {
                        format!("export {e:?}: expected COLLECTION_ID=PLAN or COLLECTION_ID=0xHEX")
                    })?;
                    let collection_id = id
                        .trim()
                        .parse()
                        .with_context(|| format!("export {e:?}: bad collection ID"))?;
                    let plan = plan.trim();
                    let description = if plan.starts_with("0x") {
                        parse_hex(plan).with_context(|| {
                            format!("export {e:?}: a description written 0x... is an even number of hex digits")
                        })?
                    } else {
                        lockstep_plan::encode(&parse_plan(plan).with_context(|| format!("export {e:?}"))?)
                    };
                    Ok(wire::Export {
                        collection_id,
                        description,
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
                    format,
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
                                    "plan": show_description(d, x),
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
                    .map(|x| format!("{}={}", x.collection_id, show_description(d, x)))
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
    hex: bool,
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
    show_rows(&r.rows, hex);
    Ok(())
}

/// Subscribes and prints `time<TAB>row<TAB>diff` lines until `until` (or forever).
pub async fn subscribe(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    as_of: u64,
    until: Option<u64>,
    hex: bool,
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
            crate::output::line(format_args!(
                "{}\t{}\t{}",
                u.time,
                show_row(&u.row, hex),
                u.diff
            ));
        }
        match batch.upper.first() {
            None => break,
            Some(&upper) if until.is_some_and(|t| upper > t) => break,
            _ => {}
        }
    }
    Ok(())
}
