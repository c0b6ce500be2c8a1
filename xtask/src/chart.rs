//! A hand-written SVG chart of latency against process count, one line per
//! strategy, for `cargo xtask bench`. No plotting dependency: the chart is a
//! few panels of polylines, axes, ticks and a legend.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One measured point: a strategy's median on one replica shape.
#[derive(Clone, Debug)]
pub struct Point {
    /// The strategy (`broadcast`, `barrier`, `log`, `naive`).
    pub strategy: String,
    /// Processes in the replica.
    pub processes: u32,
    /// Timely workers per process.
    pub workers: u32,
    /// The median, in nanoseconds.
    pub median_ns: f64,
}

/// One panel: a title and its points.
pub struct Panel {
    /// What the panel shows, e.g. "small command".
    pub title: String,
    /// What the x axis counts: "processes", or e.g. "one-way delay (µs)"
    /// (then a point's `processes` holds that value).
    pub x_label: String,
    /// The points, in any order.
    pub points: Vec<Point>,
}

/// The fixed order and colour of the strategies; unknown ones come last, grey.
const STRATEGIES: [(&str, &str); 5] = [
    ("broadcast", "#1f77b4"),
    ("barrier", "#d62728"),
    ("log", "#2ca02c"),
    ("naive", "#7f7f7f"),
    ("log@postgres", "#9467bd"),
];

const PANEL_W: f64 = 440.0;
const PANEL_H: f64 = 300.0;
const MARGIN_L: f64 = 70.0;
const MARGIN_R: f64 = 20.0;
const MARGIN_T: f64 = 36.0;
const MARGIN_B: f64 = 50.0;
const LEGEND_H: f64 = 56.0;

fn colour(strategy: &str) -> &'static str {
    STRATEGIES
        .iter()
        .find(|(s, _)| *s == strategy)
        .map(|(_, c)| *c)
        .unwrap_or("#9467bd")
}

/// A round upper bound for an axis and its tick step.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// The unit that keeps the axis labels short.
fn unit(max_ns: f64) -> (&'static str, f64) {
    if max_ns >= 1e9 {
        ("s", 1e9)
    } else if max_ns >= 1e6 {
        ("ms", 1e6)
    } else if max_ns >= 1e3 {
        ("µs", 1e3)
    } else {
        ("ns", 1.0)
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Renders `panels` side by side (two per row) as one SVG document.
pub fn svg(title: &str, subtitle: &str, panels: &[Panel]) -> String {
    let cols = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(2).max(1);
    let width = PANEL_W * cols as f64;
    let height = 50.0 + PANEL_H * rows as f64 + LEGEND_H;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<rect width="100%" height="100%" fill="#ffffff"/>
<text x="{}" y="20" text-anchor="middle" font-size="15" font-weight="bold">{}</text>
<text x="{}" y="38" text-anchor="middle" fill="#555">{}</text>"##,
        width / 2.0,
        escape(title),
        width / 2.0,
        escape(subtitle)
    );
    for (i, panel) in panels.iter().enumerate() {
        let x0 = PANEL_W * (i % 2) as f64;
        let y0 = 50.0 + PANEL_H * (i / 2) as f64;
        draw_panel(&mut s, panel, x0, y0);
    }
    draw_legend(&mut s, panels, 50.0 + PANEL_H * rows as f64);
    s.push_str("</svg>\n");
    s
}

fn draw_panel(s: &mut String, panel: &Panel, x0: f64, y0: f64) {
    let left = x0 + MARGIN_L;
    let right = x0 + PANEL_W - MARGIN_R;
    let top = y0 + MARGIN_T;
    let bottom = y0 + PANEL_H - MARGIN_B;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">{}</text>"#,
        (left + right) / 2.0,
        y0 + 22.0,
        escape(&panel.title)
    );
    let counts: BTreeSet<u32> = panel.points.iter().map(|p| p.processes).collect();
    if counts.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#888">no data</text>"##,
            (left + right) / 2.0,
            (top + bottom) / 2.0
        );
        return;
    }
    let counts: Vec<u32> = counts.into_iter().collect();
    // Process counts are evenly spaced (they double: 1, 2, 4).
    let xs = |p: u32| -> f64 {
        let i = counts.iter().position(|c| *c == p).unwrap_or(0) as f64;
        let n = counts.len() as f64;
        left + (right - left) * (i + 0.5) / n
    };
    let max_ns = panel.points.iter().map(|p| p.median_ns).fold(0.0, f64::max);
    let (unit_name, unit_ns) = unit(max_ns);
    let (top_val, step) = nice_axis(max_ns / unit_ns);
    let ys = |ns: f64| bottom - (bottom - top) * (ns / unit_ns) / top_val;

    // Grid, ticks and tick labels.
    let mut v = 0.0;
    while v <= top_val + step / 2.0 {
        let y = bottom - (bottom - top) * v / top_val;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#e5e5e5"/>
<text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            left - 6.0,
            y + 4.0,
            trim(v)
        );
        v += step;
    }
    for &c in &counts {
        let x = xs(c);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{bottom}" x2="{x:.1}" y2="{}" stroke="#333"/>
<text x="{x:.1}" y="{}" text-anchor="middle">{c}</text>"##,
            bottom + 5.0,
            bottom + 18.0
        );
    }
    // Axes and their labels.
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>
<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text transform="translate({},{}) rotate(-90)" text-anchor="middle">median latency ({unit_name})</text>"##,
        (left + right) / 2.0,
        bottom + 36.0,
        escape(&panel.x_label),
        x0 + 18.0,
        (top + bottom) / 2.0
    );

    // One line per (strategy, workers per process).
    let mut lines: BTreeMap<(usize, String, u32), Vec<&Point>> = BTreeMap::new();
    for p in &panel.points {
        let order = STRATEGIES
            .iter()
            .position(|(n, _)| *n == p.strategy)
            .unwrap_or(STRATEGIES.len());
        lines
            .entry((order, p.strategy.clone(), p.workers))
            .or_default()
            .push(p);
    }
    for ((_, strategy, workers), mut pts) in lines {
        pts.sort_by_key(|p| p.processes);
        let c = colour(&strategy);
        let dash = if workers > 1 {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        // A line joins neighbouring process counts only: a shape that was
        // not measured leaves a gap rather than a made-up segment.
        let slot = |p: &Point| counts.iter().position(|c| *c == p.processes);
        for pair in pts.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if slot(b).zip(slot(a)).is_some_and(|(j, i)| j == i + 1) {
                let _ = writeln!(
                    s,
                    r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{c}" stroke-width="2"{dash}/>"#,
                    xs(a.processes),
                    ys(a.median_ns),
                    xs(b.processes),
                    ys(b.median_ns)
                );
            }
        }
        let fill = if workers > 1 { "#ffffff" } else { c };
        for p in pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{fill}" stroke="{c}" stroke-width="2"><title>{} ({} {}, {} worker(s) per process): {}</title></circle>"#,
                xs(p.processes),
                ys(p.median_ns),
                escape(&p.strategy),
                escape(&panel.x_label),
                p.processes,
                p.workers,
                crate::bench::human(p.median_ns)
            );
        }
    }
}

fn draw_legend(s: &mut String, panels: &[Panel], y: f64) {
    let present: BTreeSet<&str> = panels
        .iter()
        .flat_map(|p| p.points.iter().map(|q| q.strategy.as_str()))
        .collect();
    let mut names: Vec<&str> = STRATEGIES
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| present.contains(n))
        .collect();
    names.extend(
        present
            .iter()
            .filter(|n| !STRATEGIES.iter().any(|(m, _)| m == *n)),
    );
    let mut x = 20.0;
    let y = y + 18.0;
    for n in names {
        let c = colour(n);
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{c}" stroke-width="3"/>
<circle cx="{}" cy="{y}" r="4" fill="{c}"/>
<text x="{}" y="{}">{}</text>"#,
            x + 28.0,
            x + 14.0,
            x + 34.0,
            y + 4.0,
            escape(n)
        );
        x += 110.0;
    }
    let _ = writeln!(
        s,
        r##"<text x="20" y="{}" fill="#555">solid line, filled dot: 1 worker per process; dashed line, hollow dot: 2 workers per process. Lower is better.</text>"##,
        y + 26.0
    );
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_axes_cover_the_maximum() {
        for max in [0.7, 1.0, 3.2, 47.0, 151.0, 999.0] {
            let (top, step) = nice_axis(max);
            assert!(top >= max && top / step <= 10.0, "{max}: {top} {step}");
        }
    }

    #[test]
    fn renders_lines_points_and_legend() {
        let p = |s: &str, processes, workers, ns| Point {
            strategy: s.into(),
            processes,
            workers,
            median_ns: ns,
        };
        let svg = svg(
            "t",
            "sub",
            &[Panel {
                title: "small command".into(),
                x_label: "processes".into(),
                points: vec![
                    p("barrier", 1, 1, 80e3),
                    p("barrier", 2, 1, 110e3),
                    p("barrier", 2, 2, 160e3),
                    p("naive", 1, 1, 90e3),
                ],
            }],
        );
        assert!(svg.starts_with("<svg"));
        // barrier 1x1 -> 2x1 is joined; nothing else has a neighbour.
        assert_eq!(svg.matches("stroke-width=\"2\"/>").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 4 + 2);
        assert!(svg.contains("median latency (µs)"));
        assert!(svg.contains(">processes<"));
    }
}
