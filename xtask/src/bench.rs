//! `cargo xtask bench [--quick]`: runs the criterion suite in `benches/`,
//! then writes `target/lockstep/bench.json` (one object per benchmark: name,
//! median in nanoseconds, and the ratio to its baseline where one exists) and
//! prints the same as a Markdown table (the reporting contract of DESIGN.md).
//!
//! Baselines: a strategy's figures are compared with `naive` on the same
//! replica in the same run (DESIGN.md names `broadcast` as the baseline, but
//! broadcast is not built yet); a WASM policy's with the same logic in native
//! Rust. Not built yet: the latency-against-process-count chart of issue 7.

use std::path::Path;

use anyhow::Context;

use crate::util::{cargo, root, run, step};

/// One measured benchmark.
struct Row {
    name: String,
    median_ns: f64,
}

fn collect(dir: &Path, out: &mut Vec<Row>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if !path.is_dir() {
            continue;
        }
        let meta = path.join("new/benchmark.json");
        let est = path.join("new/estimates.json");
        if meta.exists() && est.exists() {
            let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta)?)?;
            let est: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&est)?)?;
            let name = meta["full_id"].as_str().unwrap_or_default().to_string();
            let median_ns = est["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            out.push(Row { name, median_ns });
        } else {
            collect(&path, out)?;
        }
    }
    Ok(())
}

fn baseline_of(name: &str) -> Option<String> {
    if name.contains("/barrier/") {
        return Some(name.replace("/barrier/", "/naive/"));
    }
    if name.contains("wasm") {
        return Some(name.replace("wasm", "native"));
    }
    None
}

fn human(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Builds what the benchmarks need, runs them, writes the report.
pub fn bench(quick: bool) -> anyhow::Result<()> {
    step("building the release replica and the policies");
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--quiet", "-p", "lockstep-replica"]);
    run(cmd)?;
    crate::policies::build_all()?;
    let criterion_dir = root().join("target/criterion");
    if criterion_dir.exists() {
        // Only this run's figures go into the report.
        std::fs::remove_dir_all(&criterion_dir).context("clearing old criterion results")?;
    }
    step(if quick {
        "criterion (quick)"
    } else {
        "criterion"
    });
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "lockstep-benches", "--benches", "--"]);
    if quick {
        cmd.args(["--warm-up-time", "0.5", "--measurement-time", "1"]);
    }
    run(cmd)?;

    let mut rows = Vec::new();
    collect(&criterion_dir, &mut rows)?;
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    let medians: std::collections::BTreeMap<String, f64> =
        rows.iter().map(|r| (r.name.clone(), r.median_ns)).collect();
    let mut json = Vec::new();
    let mut table =
        String::from("| benchmark | median | baseline | ratio |\n| --- | ---: | --- | ---: |\n");
    for r in &rows {
        let base = baseline_of(&r.name).filter(|b| medians.contains_key(b));
        let ratio = base.as_ref().map(|b| r.median_ns / medians[b]);
        let mut obj = serde_json::json!({ "name": r.name, "median_ns": r.median_ns });
        if let (Some(b), Some(x)) = (&base, ratio) {
            obj["baseline"] = serde_json::json!(b);
            obj["ratio"] = serde_json::json!(x);
        }
        json.push(obj);
        table.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            r.name,
            human(r.median_ns),
            base.clone().unwrap_or_else(|| "-".into()),
            ratio
                .map(|x| format!("{x:.2}x"))
                .unwrap_or_else(|| "-".into())
        ));
    }
    let out = root().join("target/lockstep/bench.json");
    std::fs::create_dir_all(out.parent().expect("a parent"))?;
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    println!("\n{table}");
    eprintln!("xtask: wrote {} ({} benchmarks)", out.display(), rows.len());
    Ok(())
}
