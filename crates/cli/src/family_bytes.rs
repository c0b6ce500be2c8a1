//! How the CLI reads and writes a family's descriptions and rows: the
//! built-in family's plans and integer rows, another family's bytes as
//! text, a file (`@FILE`) or hex (`0x...`), never parsed as plans.

use anyhow::Context;
use lockstep_plan::text::parse_plan;
use lockstep_protocol::proto as wire;

/// The family whose descriptions and rows a command reads and writes, from
/// the format the environment serves (or `dataflow create --format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// The built-in family (`lockstep.plan.v1`): descriptions are plans,
    /// rows are 64-bit integers.
    Plans,
    /// Another family: its descriptions and rows are its own bytes, which
    /// the CLI never reads as plans or integers.
    Foreign,
}

impl Family {
    /// The family of `format`; `""` (an environment older than
    /// `GetStatusResponse.format`, v0.2.0) is the built-in family.
    pub fn of(format: &str) -> Family {
        if format.is_empty() || format == lockstep_plan::FORMAT {
            Family::Plans
        } else {
            Family::Foreign
        }
    }
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

/// The bytes of the file `path` names (an argument's `@FILE`, without the
/// `@`).
fn read_file(what: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(!path.is_empty(), "{what}: `@` and no file name");
    std::fs::read(path).with_context(|| format!("{what}: reading {path}"))
}

/// Parses `--export COLLECTION_ID=VALUE` for `family`: `0xHEX` (the
/// description's bytes in hex) and `@FILE` for every family; for the
/// built-in family a plan (in FILE or in VALUE), for another family FILE's
/// bytes or VALUE's UTF-8 bytes as written.
pub fn parse_export(e: &str, family: Family) -> anyhow::Result<wire::Export> {
    let (id, value) = e.split_once('=').with_context(|| match family {
        Family::Plans => format!("export {e:?}: expected COLLECTION_ID=PLAN, =@FILE or =0xHEX"),
        Family::Foreign => {
            format!("export {e:?}: expected COLLECTION_ID=TEXT, =@FILE or =0xHEX")
        }
    })?;
    let collection_id = id
        .trim()
        .parse()
        .with_context(|| format!("export {e:?}: bad collection ID"))?;
    let what = format!("export {e:?}");
    let plan = |text: &str| -> anyhow::Result<Vec<u8>> {
        Ok(lockstep_plan::encode(
            &parse_plan(text.trim()).with_context(|| what.clone())?,
        ))
    };
    let description = match family {
        Family::Plans => {
            let value = value.trim();
            if value.starts_with("0x") {
                hex_arg(&what, "description", value)?
            } else if let Some(path) = value.strip_prefix('@') {
                let text = String::from_utf8(read_file(&what, path)?)
                    .map_err(|_| anyhow::anyhow!("{what}: {path} is not UTF-8 plan text"))?;
                plan(&text)?
            } else {
                plan(value)?
            }
        }
        Family::Foreign => {
            if value.starts_with("0x") {
                hex_arg(&what, "description", value)?
            } else if let Some(path) = value.strip_prefix('@') {
                read_file(&what, path)?
            } else {
                value.as_bytes().to_vec()
            }
        }
    };
    Ok(wire::Export {
        collection_id,
        description,
    })
}

/// `0xHEX`'s bytes, or an error saying how to write them.
fn hex_arg(what: &str, of: &str, value: &str) -> anyhow::Result<Vec<u8>> {
    parse_hex(value).with_context(|| {
        format!(
            "{what}: a {of} written 0x... is an even number of hex digits \
             (write one that starts with 0x in a file: @FILE)"
        )
    })
}

/// Parses `--update ROW@TIME[:DIFF]` for `family`: the time is after the
/// last `@` (a row may hold `@`), the diff (default 1) after the first `:`
/// that follows it. ROW is `0xHEX` (the row's bytes in hex) or `@FILE` (the
/// bytes of FILE as they are, for the built-in family its encoding) for
/// every family; otherwise, for the built-in family, comma-separated
/// integers (`1,10`; empty: the row of no columns), and for another family
/// its UTF-8 bytes as written.
pub fn parse_update(s: &str, family: Family) -> anyhow::Result<wire::Update> {
    let (row, rest) = s.rsplit_once('@').with_context(|| {
        format!("update {s:?}: expected ROW@TIME[:DIFF], e.g. 1,10@0:1, TEXT@0 or @FILE@0")
    })?;
    let (time, diff) = match rest.split_once(':') {
        Some((t, d)) => (
            t,
            d.parse()
                .with_context(|| format!("update {s:?}: bad diff {d:?}"))?,
        ),
        None => (rest, 1),
    };
    let time = time.parse().with_context(|| {
        format!("update {s:?}: bad time {time:?} (the time is after the last @)")
    })?;
    let what = format!("update {s:?}");
    let row = if row.starts_with("0x") {
        hex_arg(&what, "row", row)?
    } else if let Some(path) = row.strip_prefix('@') {
        read_file(&what, path)?
    } else {
        match family {
            Family::Foreign => row.as_bytes().to_vec(),
            Family::Plans if row.is_empty() => lockstep_plan::row(&[]),
            Family::Plans => {
                let values: Vec<i64> = row
                    .split(',')
                    .map(|v| v.trim().parse::<i64>())
                    .collect::<Result<_, _>>()
                    .with_context(|| {
                        format!(
                            "update {s:?}: a row is comma-separated integers, 0x and hex \
                             digits, or @FILE"
                        )
                    })?;
                lockstep_plan::row(&values)
            }
        }
    };
    Ok(wire::Update { row, time, diff })
}

/// `0x` and `bytes` in hex.
fn show_hex(bytes: &[u8]) -> String {
    std::iter::once("0x".to_string())
        .chain(bytes.iter().map(|b| format!("{b:02x}")))
        .collect()
}

/// Whether `c` may stand in text the CLI prints for a foreign family's
/// bytes: no control character (tab only if `tab`), no whitespace other
/// than space (and tab), and none of the invisible format characters
/// (zero-width, bidirectional controls, soft hyphen, byte-order mark).
fn printable(c: char, tab: bool) -> bool {
    if c == '\t' {
        return tab;
    }
    let invisible = matches!(
        c,
        '\u{ad}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206f}'
            | '\u{feff}'
    );
    !c.is_control() && (c == ' ' || !c.is_whitespace()) && !invisible
}

/// `bytes` as text, if they print as such and read back as the same bytes
/// (`--export ID=TEXT`, `--update TEXT@T`): UTF-8, not empty, every
/// character [`printable`], not starting with `0x` or `@` (which those
/// read as hex or a file name).
fn as_text(bytes: &[u8], tab: bool) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    let plain = !text.is_empty()
        && !text.starts_with("0x")
        && !text.starts_with('@')
        && text.chars().all(|c| printable(c, tab));
    plain.then_some(text)
}

/// A row as the CLI prints it: `0x` and its bytes in hex if `hex`;
/// otherwise a row of the built-in family as its comma-separated integers,
/// a row of another family as its text if it is printable (tabs allowed:
/// the row is the field between the time and the diff, which are tab-free)
/// and as hex if not (or if it does not decode).
pub fn show_row(row: &[u8], family: Family, hex: bool) -> String {
    if hex {
        return show_hex(row);
    }
    match family {
        Family::Plans => match lockstep_plan::rows::decode(row) {
            Ok(values) => values
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(","),
            Err(_) => show_hex(row),
        },
        Family::Foreign => as_text(row, true).map_or_else(|| show_hex(row), str::to_string),
    }
}

/// An export's description as the CLI prints it, in the syntax `--export`
/// takes: a plan, or another family's description as its text if it is
/// printable (no tab: it stands in a table cell) and as `0x` and its bytes
/// in hex if not.
pub fn show_description(
    d: &lockstep_protocol::DataflowDescription,
    x: &lockstep_protocol::Export,
) -> String {
    match Family::of(&d.format) {
        Family::Plans => lockstep_plan::display(x),
        Family::Foreign => {
            as_text(&x.description, false).map_or_else(|| show_hex(&x.description), str::to_string)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(bytes: &[u8]) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bytes@x");
        std::fs::write(&path, bytes).unwrap();
        (dir, path.to_str().unwrap().to_string())
    }

    fn update(s: &str, family: Family) -> (Vec<u8>, u64, i64) {
        let u = parse_update(s, family).unwrap_or_else(|e| panic!("{s:?}: {e:#}"));
        (u.row, u.time, u.diff)
    }

    #[test]
    fn the_family_of_a_format() {
        assert_eq!(Family::of(lockstep_plan::FORMAT), Family::Plans);
        assert_eq!(Family::of(""), Family::Plans);
        assert_eq!(
            Family::of("lockstep.example.reachability.v2"),
            Family::Foreign
        );
    }

    #[test]
    fn updates_of_the_built_in_family_are_integers_as_before() {
        let p = Family::Plans;
        assert_eq!(update("1,10@0", p), (lockstep_plan::row(&[1, 10]), 0, 1));
        assert_eq!(
            update("1, -3@2:-1", p),
            (lockstep_plan::row(&[1, -3]), 2, -1)
        );
        assert_eq!(update("@7", p), (lockstep_plan::row(&[]), 7, 1));
        assert_eq!(update("0x0102@3:2", p), (vec![1, 2], 3, 2));
        for bad in ["1,10", "a,b@0", "1@x", "1@0:y", "0x1@0", "1@0@1"] {
            assert!(parse_update(bad, p).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn updates_of_another_family_are_their_text_as_written() {
        let f = Family::Foreign;
        assert_eq!(update("n8\tn9@4", f), (b"n8\tn9".to_vec(), 4, 1));
        // Never read as integers, nor trimmed; empty is empty.
        assert_eq!(update("1,10@0", f), (b"1,10".to_vec(), 0, 1));
        assert_eq!(update(" a b @1:-2", f), (b" a b ".to_vec(), 1, -2));
        assert_eq!(update("@0", f), (vec![], 0, 1));
        // The time is after the last `@`, the diff after the `:` there.
        assert_eq!(update("a@b:c@5:3", f), (b"a@b:c".to_vec(), 5, 3));
        assert_eq!(update("0xff00@1", f), (vec![0xff, 0], 1, 1));
        for bad in ["text", "0xf@0", "0xzz@0", "a@", "a@1:", "a@-1"] {
            assert!(parse_update(bad, f).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_update_at_file_is_the_files_bytes_for_every_family() {
        let (_dir, path) = file(b"0x\xff\n@");
        for family in [Family::Plans, Family::Foreign] {
            assert_eq!(
                update(&format!("@{path}@3:-1"), family),
                (b"0x\xff\n@".to_vec(), 3, -1)
            );
        }
        let e = parse_update("@/no/such/file@0", Family::Foreign).unwrap_err();
        assert!(format!("{e:#}").contains("/no/such/file"), "{e:#}");
        assert!(parse_update("@@0", Family::Foreign).is_err());
    }

    #[test]
    fn exports_by_family() {
        let plan = "reduce(get(1), [#0], count)";
        let encoded = lockstep_plan::encode(&parse_plan(plan).unwrap());
        let x = parse_export(&format!("101= {plan} "), Family::Plans).unwrap();
        assert_eq!((x.collection_id, x.description), (101, encoded.clone()));
        let (_dir, path) = file(format!("{plan}\n").as_bytes());
        let x = parse_export(&format!("101=@{path}"), Family::Plans).unwrap();
        assert_eq!(x.description, encoded);
        assert!(parse_export("101=n7", Family::Plans).is_err());
        // Another family: text as written, never a plan; the file as is.
        let x = parse_export(&format!("7={plan}"), Family::Foreign).unwrap();
        assert_eq!(
            (x.collection_id, x.description),
            (7, plan.as_bytes().to_vec())
        );
        let x = parse_export("7= n7=x", Family::Foreign).unwrap();
        assert_eq!(x.description, b" n7=x");
        let x = parse_export(&format!("7=@{path}"), Family::Foreign).unwrap();
        assert_eq!(x.description, format!("{plan}\n").into_bytes());
        for family in [Family::Plans, Family::Foreign] {
            let x = parse_export("8=0x6e37", family).unwrap();
            assert_eq!(x.description, b"n7");
            for bad in ["n7", "x=n7", "8=0x6e3", "8=@", "8=@/no/such/file"] {
                assert!(parse_export(bad, family).is_err(), "{bad:?} {family:?}");
            }
        }
    }

    #[test]
    fn rows_print_by_family() {
        let p = Family::Plans;
        let f = Family::Foreign;
        let ints = lockstep_plan::row(&[1, -10]);
        assert_eq!(show_row(&ints, p, false), "1,-10");
        assert_eq!(show_row(&ints, p, true), show_hex(&ints));
        // A built-in row that does not decode prints in hex, as before.
        assert_eq!(show_row(&[0xff], p, false), "0xff");
        // Another family's printable text as it is, tabs included; the
        // same bytes are never read as integers.
        assert_eq!(show_row(b"n9\t2", f, false), "n9\t2");
        assert_eq!(show_row(b"a b@c", f, false), "a b@c");
        assert_eq!(show_row(b"caf\xc3\xa9", f, false), "café");
        assert_eq!(show_row(&ints, f, false), show_hex(&ints));
        assert_eq!(show_row(b"n9\t2", f, true), "0x6e390932");
        // What would not read back as the same bytes, or not print, is hex.
        for row in [
            &b""[..],
            b"0x12",
            b"@file",
            b"a\nb",
            b"a\rb",
            b"\x1b[31m",
            b"a\x7fb",
            b"\xff",
            "a\u{a0}b".as_bytes(),
            "a\u{2028}b".as_bytes(),
            "a\u{202e}b".as_bytes(),
            "a\u{200b}b".as_bytes(),
            "\u{feff}a".as_bytes(),
        ] {
            assert_eq!(show_row(row, f, false), show_hex(row), "{row:?}");
        }
        // Whatever prints as text reads back as the same row.
        for row in [&b"n9\t2"[..], b" x ", b"a@b:c", b"1,10"] {
            let printed = show_row(row, f, false);
            let u = parse_update(&format!("{printed}@0"), f).unwrap();
            assert_eq!(u.row, row);
        }
    }

    #[test]
    fn descriptions_print_in_the_syntax_export_takes() {
        let d = |format: &str, description: &[u8]| {
            let x = lockstep_protocol::Export {
                collection_id: 103,
                description: description.to_vec(),
            };
            let d = lockstep_protocol::DataflowDescription {
                id: 1,
                as_of: 0,
                inputs: vec![1],
                exports: vec![x.clone()],
                debug_name: String::new(),
                format: format.into(),
            };
            show_description(&d, &x)
        };
        let other = "lockstep.example.reachability.v2";
        assert_eq!(d(other, b"n7"), "n7");
        // No tab in a table cell.
        assert_eq!(d(other, b"a\tb"), "0x610962");
        assert_eq!(d(other, b"0x"), "0x3078");
        let plan = lockstep_plan::encode(&parse_plan("get(1)").unwrap());
        let shown = d(lockstep_plan::FORMAT, &plan);
        let x = parse_export(&format!("103={shown}"), Family::Plans).unwrap();
        assert_eq!(x.description, plan);
    }
}
