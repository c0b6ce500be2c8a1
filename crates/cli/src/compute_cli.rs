//! The compute commands of the `lockstep` CLI: dataflows, inputs, peeks and
//! subscribes against a running environment.

use anyhow::Context;
use clap::Subcommand;
use futures::StreamExt;
use lockstep_api::proto;
use lockstep_protocol::proto as wire;

use crate::family_bytes::{parse_export, parse_update, show_description, show_row, Family};

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
        /// An export as `COLLECTION_ID=VALUE` (repeat for several). For the
        /// built-in family (format `lockstep.plan.v1`) VALUE is a plan, e.g.
        /// `101=reduce(get(1), [#0], count, sum(#1))`, or `@FILE`: a plan
        /// read from FILE. For another family (the format the environment
        /// serves, see `lockstep status`, or `--format`) VALUE is the
        /// description's bytes: `@FILE` the bytes of FILE as they are, any
        /// other VALUE its UTF-8 bytes as written (never read as a plan or
        /// as integers). For every family, `0xHEX` (`0x` and an even number
        /// of hex digits) is the description's bytes in hex; write a
        /// description that starts with `0x` or `@` in a file.
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
    /// in the syntax `--export` takes: a plan of the built-in family; a
    /// description of another family as its text if it is printable (UTF-8
    /// without control, invisible-format or whitespace characters other
    /// than space, not empty, not starting with `0x` or `@`), else as `0x`
    /// and its bytes in hex.
    List {
        #[command(flatten)]
        output: crate::output::OutputArg,
    },
}

/// The format the environment's replicas build, from `GetStatus`.
pub async fn served_format(client: &mut crate::Client) -> anyhow::Result<String> {
    let status = client
        .get_status(proto::GetStatusRequest {})
        .await
        .map_err(status_err)
        .context("asking the environment which format it serves (GetStatus)")?
        .into_inner();
    Ok(status.format)
}

pub(crate) fn status_err(s: tonic::Status) -> anyhow::Error {
    // An answer over this client's decoding limit fails here, in tonic, as
    // OUT_OF_RANGE, which the API uses for reads below a since: say what it
    // is (the environment itself refuses a larger answer with
    // RESOURCE_EXHAUSTED before sending it).
    if s.code() == tonic::Code::OutOfRange && s.message().contains("message length too large") {
        return anyhow::anyhow!(
            "{}: the answer is larger than this client's limit of {} bytes: {}",
            crate::code_name(tonic::Code::ResourceExhausted),
            lockstep_api::MAX_ANSWER_BYTES,
            s.message()
        );
    }
    anyhow::anyhow!("{}: {}", crate::code_name(s.code()), s.message())
}

fn show_rows(rows: &[wire::Row], family: Family, hex: bool) {
    for r in rows {
        crate::output::line(format_args!(
            "{}\t{}",
            show_row(&r.values, family, hex),
            r.diff
        ));
    }
}

/// The family of a peek's or subscription's rows: any will do with `hex`
/// (every row prints in hex), so the environment is asked only without it.
async fn family_to_show(client: &mut crate::Client, hex: bool) -> anyhow::Result<Family> {
    if hex {
        return Ok(Family::Foreign);
    }
    Ok(Family::of(&served_format(client).await?))
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
            // The family of the exports' syntax: the one `--format` names,
            // else the environment's.
            let family = if format.is_empty() {
                Family::of(&served_format(client).await?)
            } else {
                Family::of(&format)
            };
            let exports = exports
                .iter()
                .map(|e| parse_export(e, family))
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
    let family = Family::of(&served_format(client).await?);
    let updates = updates
        .iter()
        .map(|u| parse_update(u, family))
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

/// Peeks a collection and prints `row<TAB>count` lines ([`show_row`]).
pub async fn peek(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    timestamp: u64,
    hex: bool,
) -> anyhow::Result<()> {
    let family = family_to_show(client, hex).await?;
    let r = client
        .peek(proto::PeekRequest {
            replica,
            collection_id,
            timestamp,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    show_rows(&r.rows, family, hex);
    Ok(())
}

/// Subscribes and prints `time<TAB>row<TAB>diff` lines ([`show_row`]) until
/// `until` (or forever).
pub async fn subscribe(
    client: &mut crate::Client,
    replica: String,
    collection_id: u64,
    as_of: u64,
    until: Option<u64>,
    hex: bool,
    resume: Option<std::time::Duration>,
) -> anyhow::Result<()> {
    let family = family_to_show(client, hex).await?;
    // The last time every update of which was printed (the last upper - 1).
    let mut received: Option<u64> = None;
    // When the connection was lost, if it is being resumed.
    let mut lost: Option<(std::time::Instant, String)> = None;
    loop {
        let request = proto::SubscribeRequest {
            replica: replica.clone(),
            collection_id,
            as_of: received.unwrap_or(as_of),
            resume: received.is_some(),
        };
        let ended = match client.subscribe(request).await {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    let batch = match stream.next().await {
                        None => break Ok(()),
                        Some(Err(status)) => break Err(status),
                        Some(Ok(batch)) => batch,
                    };
                    if let Some((_, why)) = lost.take() {
                        eprintln!("subscribe: resumed after the connection was lost ({why})");
                    }
                    for u in &batch.updates {
                        crate::output::line(format_args!(
                            "{}\t{}\t{}",
                            u.time,
                            show_row(&u.row, family, hex),
                            u.diff
                        ));
                    }
                    match batch.upper.first() {
                        None => return Ok(()),
                        Some(&upper) if until.is_some_and(|t| upper > t) => return Ok(()),
                        Some(&upper) => {
                            if let Some(last) = upper.checked_sub(1) {
                                received = Some(received.map_or(last, |r| r.max(last)));
                            }
                        }
                    }
                }
            }
            Err(status) => Err(status),
        };
        let status = match ended {
            // The stream ended without its last batch: the server went away.
            Ok(()) => tonic::Status::unavailable("the stream ended early"),
            Err(status) => status,
        };
        let Some(bound) = resume.filter(|_| resumable(&status)) else {
            return Err(status_err(status));
        };
        let since = match &lost {
            Some((since, _)) => *since,
            None => {
                let at =
                    received.map_or("from the start".to_string(), |r| format!("after time {r}"));
                eprintln!(
                    "subscribe: connection lost ({}); resuming {at}",
                    status.message()
                );
                std::time::Instant::now()
            }
        };
        if since.elapsed() > bound {
            return Err(anyhow::anyhow!(
                "subscribe: could not resume within {bound:?}: {}",
                status_err(status)
            ));
        }
        lost = Some((since, status.message().to_string()));
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Whether a failed subscription may be resumed: the server or the
/// connection went away, not a refusal.
fn resumable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}
