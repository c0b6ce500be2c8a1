//! How the CLI's list and status commands print: `-o table` (the default),
//! columns as wide as their widest cell, or `-o json`, one JSON document on
//! stdout for scripts (its shape is documented on each command).

use clap::ValueEnum;

/// The output format of a list or status command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    #[default]
    Table,
    /// One JSON document (pretty-printed) for scripts.
    Json,
}

/// The `-o/--output` option of a list or status command.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct OutputArg {
    /// The output format: `table` for people, `json` for scripts (one JSON
    /// document on stdout).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

impl OutputArg {
    /// Whether JSON was asked for.
    pub fn json(self) -> bool {
        self.output == Output::Json
    }
}

/// Prints `value` as one JSON document.
pub fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    write_stdout(text.as_bytes())
}

/// Writes `bytes` to stdout; a reader that went away (`| head`) is not an
/// error.
pub fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Writes one line to stdout; once the reader went away (`peek | head`,
/// `subscribe | head`) the command ends quietly with exit code 0, instead
/// of a panic on the broken pipe.
pub fn line(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(text).and_then(|()| out.write_all(b"\n")) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("lockstep: error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

/// How a column's cells line up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// A table whose columns are as wide as their widest cell (header
/// included), two spaces apart; the last column is not padded.
#[derive(Debug)]
pub struct Table {
    columns: Vec<(&'static str, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these headers and alignments.
    pub fn new(columns: &[(&'static str, Align)]) -> Self {
        Table {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells are empty, extra ones dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The header line, then one line per row.
    pub fn lines(&self) -> Vec<String> {
        let cell = |row: &[String], i: usize| row.get(i).cloned().unwrap_or_default();
        let widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, (header, _))| {
                self.rows
                    .iter()
                    .map(|r| cell(r, i).chars().count())
                    .chain([header.chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<String>| {
            let last = cells.len().saturating_sub(1);
            let mut out = String::new();
            for (i, text) in cells.into_iter().enumerate() {
                if i > 0 {
                    out.push_str("  ");
                }
                let pad = widths[i].saturating_sub(text.chars().count());
                match self.columns[i].1 {
                    Align::Right => {
                        out.push_str(&" ".repeat(pad));
                        out.push_str(&text);
                    }
                    Align::Left if i == last => out.push_str(&text),
                    Align::Left => {
                        out.push_str(&text);
                        out.push_str(&" ".repeat(pad));
                    }
                }
            }
            out.trim_end().to_string()
        };
        let header = line(self.columns.iter().map(|(h, _)| h.to_string()).collect());
        std::iter::once(header)
            .chain(
                self.rows
                    .iter()
                    .map(|r| line((0..self.columns.len()).map(|i| cell(r, i)).collect())),
            )
            .collect()
    }

    /// Prints [`lines`](Self::lines).
    pub fn print(&self) {
        for l in self.lines() {
            println!("{l}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_as_wide_as_their_widest_cell() {
        let mut t = Table::new(&[
            ("ID", Align::Right),
            ("NAME", Align::Left),
            ("X", Align::Left),
        ]);
        t.row(vec![
            "7".into(),
            "a-very-long-replica-name".into(),
            "x".into(),
        ]);
        t.row(vec!["1234".into(), "b".into(), "yy".into()]);
        let lines = t.lines();
        assert_eq!(lines[0], "  ID  NAME                      X");
        assert_eq!(lines[1], "   7  a-very-long-replica-name  x");
        assert_eq!(lines[2], "1234  b                         yy");
    }
}
