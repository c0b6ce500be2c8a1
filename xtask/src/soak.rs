//! `cargo xtask soak [--quick]`: builds the release binaries, runs
//! `lockstep soak` (see `crates/cli/src/soak.rs`), and judges its
//! report: every figure's `end_over_start` must be at most the report's
//! `flat_bound`. Writes `target/lockstep/soak.json` (the report) and
//! `target/lockstep/soak.svg` (one panel per figure over the rounds), prints
//! the figures, and `soak: ok` at the end.

use std::fmt::Write as _;

use anyhow::{bail, Context};

use crate::util::{cargo, root, run, step};

/// The figures in report order, with their units.
const FIGURES: [(&str, &str); 6] = [
    ("write_p50_ms", "write p50 (ms)"),
    ("peek_p50_ms", "peek p50 (ms)"),
    ("reconnect_ms", "reconnection (ms)"),
    ("rss_environment_mib", "environment RSS (MiB)"),
    ("rss_replica_mib", "replica RSS, all processes (MiB)"),
    ("disk_mib", "state directory (MiB)"),
];

/// Builds, runs and judges the soak.
pub fn soak(quick: bool) -> anyhow::Result<()> {
    step("building the release environment and replica");
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "lockstep-cli",
        "-p",
        "lockstep-replica",
        "--features",
        "lockstep-cli/soak",
    ]);
    run(cmd)?;
    let out_dir = root().join("target/lockstep");
    std::fs::create_dir_all(&out_dir)?;
    let json = out_dir.join("soak.json");
    step(if quick { "soak (quick)" } else { "soak" });
    let mut cmd = std::process::Command::new(root().join("target/release/lockstep"));
    cmd.arg("soak").arg("--out").arg(&json);
    if quick {
        cmd.arg("--quick");
    }
    run(cmd)?;
    let report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&json).with_context(|| format!("reading {}", json.display()))?,
    )?;
    let svg = chart(&report);
    std::fs::write(out_dir.join("soak.svg"), svg)?;
    let bound = report["flat_bound"].as_f64().context("no flat_bound")?;
    println!(
        "\nsoak: {} rows written, {} dataflows created and dropped, {} environment restarts, {:.0} s",
        report["rows_written"],
        report["dataflows_created"],
        report["environment_restarts"],
        report["wall_secs"].as_f64().unwrap_or(f64::NAN)
    );
    println!("| figure | start | end | end / start |\n| --- | ---: | ---: | ---: |");
    let mut failed = Vec::new();
    for (name, _) in FIGURES {
        let f = &report["figures"][name];
        let ratio = f["end_over_start"].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {name} | {:.2} | {:.2} | {ratio:.2} |",
            f["start"].as_f64().unwrap_or(f64::NAN),
            f["end"].as_f64().unwrap_or(f64::NAN)
        );
        // NaN (a figure not measured) fails too.
        if ratio.is_nan() || ratio > bound {
            failed.push(format!("{name} {ratio:.2}"));
        }
    }
    if quick && report["rows_written"].as_u64().unwrap_or(0) < 1_000_000 {
        failed.push("fewer than 1,000,000 rows written".into());
    }
    eprintln!(
        "xtask: wrote {} and {}",
        json.display(),
        out_dir.join("soak.svg").display()
    );
    if !failed.is_empty() {
        bail!("soak: not flat (bound {bound}): {}", failed.join(", "));
    }
    println!("soak: ok");
    Ok(())
}

/// One small line chart per figure, x = round.
fn chart(report: &serde_json::Value) -> String {
    let rounds = report["rounds"].as_array().cloned().unwrap_or_default();
    let (w, h, cols) = (360.0, 200.0, 3usize);
    let rows = FIGURES.len().div_ceil(cols);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="11">"#,
        w * cols as f64,
        h * rows as f64 + 30.0
    );
    let _ = write!(
        s,
        r#"<text x="10" y="18" font-size="14">lockstep soak: {} rows, {} restarts (x: round)</text>"#,
        report["rows_written"], report["environment_restarts"]
    );
    for (i, (name, title)) in FIGURES.iter().enumerate() {
        let (ox, oy) = ((i % cols) as f64 * w, (i / cols) as f64 * h + 30.0);
        let points: Vec<(f64, f64)> = rounds
            .iter()
            .filter_map(|r| Some((r["round"].as_f64()?, r[*name].as_f64()?)))
            .collect();
        let max_x = points.iter().map(|p| p.0).fold(1.0, f64::max);
        let max_y = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
        let (px, py, pw, ph) = (ox + 50.0, oy + 20.0, w - 70.0, h - 50.0);
        let _ = write!(
            s,
            r##"<text x="{}" y="{}">{title}</text><rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>"##,
            ox + 50.0,
            oy + 14.0
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{max_y:.1}</text><text x="{}" y="{}" text-anchor="end">0</text>"#,
            px - 4.0,
            py + 8.0,
            px - 4.0,
            py + ph
        );
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", px + x / max_x * pw, py + ph - y / max_y * ph))
            .collect();
        let _ = write!(
            s,
            r##"<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{}"/>"##,
            path.join(" ")
        );
    }
    s.push_str("</svg>\n");
    s
}
