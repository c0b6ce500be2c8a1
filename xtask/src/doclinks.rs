//! The repository's references to its own files: every path a document,
//! comment, manifest or script names (`crates/...`, `docs/...`,
//! `tests/...` and the like) must exist, so the map and the docs cannot
//! silently rot when code moves. Checked by this module's test
//! (`cargo test -p xtask`, part of `cargo xtask test`).
//!
//! A path is any word that starts with a top-level directory of the
//! repository (every one that holds a tracked file: `crates/`, `docs/`,
//! `tools/`, `templates/`, ...) or with `src/`, followed by `/`; not one the
//! code builds with `join("...")`.
//!
//! A path resolves against the repository root; one that starts with
//! `src/`, `tests/`, `benches/` or `examples/` also against the crate of
//! the file naming it (the nearest directory with a `Cargo.toml`), or, from
//! a file outside every crate (a document), against any crate. Paths with a
//! placeholder (`*`, `{`, `<`, `NAME`) are patterns, not files.
//!
//! The documents (`*.md` at the top and under `docs/`) are held to the
//! code too ([`unknown_names`]): a bare file name (`secure.rs`) must be
//! some tracked file's, and a backticked type or function name (`Pool`,
//! `Inner::wait_gone`, `pod_name()`, `KubernetesOrchestratorConfig::stuck_after`)
//! must be one the code defines (an item, a variant or a field), imports
//! (a library's type the code uses), writes as a string (`IfNotPresent`,
//! a value sent to another program) or calls (`current_exe()`), so a
//! renamed or removed name cannot stay in the docs.

use std::path::{Path, PathBuf};

/// Named paths that are not files of the repository, each with why.
const EXAMPLES: [(&str, &str, &str); 1] = [(
    "docs/usage.md",
    "policies/my-rule",
    "what docs/usage.md's `cargo xtask new-policy my-rule` example writes",
)];

/// Files not searched: this module, whose tests name missing paths on purpose.
const NOT_SEARCHED: [&str; 1] = ["xtask/src/doclinks.rs"];

/// The first components a path named in a file starts with: every
/// top-level directory holding one of `files`, and `src` (a crate's own
/// sources, resolved against the crate).
fn roots(files: &[String]) -> Vec<String> {
    let mut roots: Vec<String> = files
        .iter()
        .filter_map(|f| f.split_once('/').map(|(dir, _)| dir.to_string()))
        .collect();
    roots.push("src".to_string());
    roots.sort();
    roots.dedup();
    roots
}

/// The files whose text is searched.
fn searched(file: &str) -> bool {
    [
        ".md", ".rs", ".proto", ".toml", ".yaml", ".yml", ".wit", ".py",
    ]
    .iter()
    .any(|e| file.ends_with(e))
        || file == ".ci/run"
        || file == "Containerfile"
}

/// Every path named in `text` that looks like one of the repository's.
fn named_paths(text: &str, roots: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let is_path_char = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'/' | b'-');
    let mut i = 0;
    while i < bytes.len() {
        // A path the code builds (`dir.join("src/lib.rs")`) names a file
        // of the directory it joins, not of the repository.
        let start_ok = text.is_char_boundary(i)
            && (i == 0 || !is_path_char(bytes[i - 1]))
            && !text[..i].ends_with("join(\"");
        if start_ok {
            if let Some(root) = roots
                .iter()
                .find(|r| text[i..].starts_with(&format!("{r}/")))
            {
                let mut j = i + root.len() + 1;
                while j < bytes.len()
                    && (is_path_char(bytes[j]) || matches!(bytes[j], b'*' | b'{' | b'<'))
                {
                    j += 1;
                }
                let p = text[i..j].trim_end_matches(['.', '-']);
                if p.len() > root.len() + 1 {
                    out.push(p.to_string());
                }
                i = j;
                continue;
            }
        }
        i += 1;
    }
    out
}

/// The crate directory of `file` (relative to `root`): the nearest ancestor
/// with a `Cargo.toml`, if it is not the root itself.
fn crate_of(root: &Path, file: &str) -> Option<PathBuf> {
    let mut dir = Path::new(file).parent()?;
    loop {
        if dir.as_os_str().is_empty() {
            return None;
        }
        if root.join(dir).join("Cargo.toml").exists() {
            return Some(root.join(dir));
        }
        dir = dir.parent()?;
    }
}

/// Whether `path`, named in `file`, resolves (see the module docs).
fn resolves(root: &Path, file: &str, path: &str, crates: &[PathBuf]) -> bool {
    if root.join(path).exists() {
        return true;
    }
    let crate_relative = ["src/", "tests/", "benches/", "examples/"]
        .iter()
        .any(|p| path.starts_with(p));
    if !crate_relative {
        return false;
    }
    match crate_of(root, file) {
        Some(dir) => dir.join(path).exists(),
        None => crates.iter().any(|c| c.join(path).exists()),
    }
}

/// The (file, path) pairs of `files` (relative to `root`) whose named path
/// does not exist.
pub fn dangling(root: &Path, files: &[String]) -> Vec<(String, String)> {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    crates.extend(
        std::fs::read_dir(root.join("examples"))
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default(),
    );
    crates.push(root.join("xtask"));
    crates.push(root.join("benches"));
    let roots = roots(files);
    let mut out = Vec::new();
    for file in files
        .iter()
        .filter(|f| searched(f) && !NOT_SEARCHED.contains(&f.as_str()))
    {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        for path in named_paths(&text, &roots) {
            let pattern = path.contains(['*', '{', '<']) || path.contains("NAME");
            let example = EXAMPLES
                .iter()
                .any(|(f, p, _)| f == file && path.starts_with(p));
            if !pattern && !example && !resolves(root, file, &path, &crates) {
                out.push((file.clone(), path));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// What the code defines, imports, writes as strings and calls: the names
/// a document may cite ([`unknown_names`]).
#[derive(Default)]
struct CodeNames {
    defined: std::collections::HashSet<String>,
    imported: std::collections::HashSet<String>,
    written: std::collections::HashSet<String>,
    called: std::collections::HashSet<String>,
}

/// The keywords that define the name after them (Rust, protobuf, WIT).
const DEFINING: [&str; 18] = [
    "fn",
    "struct",
    "enum",
    "trait",
    "type",
    "const",
    "static",
    "mod",
    "union",
    "macro_rules",
    "message",
    "service",
    "rpc",
    "record",
    "variant",
    "resource",
    "interface",
    "world",
];

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifiers of `line`, each with the character after it and
/// whether an assignment (`=`, not `==`) follows it.
fn idents(line: &str) -> Vec<(&str, Option<char>, bool)> {
    let mut out = Vec::new();
    let mut start = None;
    let assigned = |rest: &str| {
        let rest = rest.trim_start();
        rest.starts_with('=') && !rest.starts_with("==") && !rest.starts_with("=>")
    };
    for (i, c) in line.char_indices() {
        match (start, is_ident_char(c)) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                out.push((&line[s..i], Some(c), assigned(&line[i..])));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((&line[s..], None, false));
    }
    out
}

impl CodeNames {
    fn read(root: &Path, files: &[String]) -> CodeNames {
        let mut names = CodeNames::default();
        for file in files
            .iter()
            .filter(|f| f.ends_with(".rs") || f.ends_with(".proto") || f.ends_with(".wit"))
        {
            let Ok(text) = std::fs::read_to_string(root.join(file)) else {
                continue;
            };
            let mut in_use = false;
            for line in text.lines() {
                // Comments are prose, not code.
                let line = line.split("//").next().unwrap_or("");
                let trimmed = line.trim_start();
                if trimmed.starts_with('*') {
                    continue;
                }
                let ids = idents(line);
                if trimmed.starts_with("use ") || trimmed.starts_with("pub use ") {
                    in_use = true;
                }
                if in_use {
                    names
                        .imported
                        .extend(ids.iter().map(|(w, _, _)| w.to_string()));
                    in_use = !line.contains(';');
                }
                for pair in ids.windows(2) {
                    if DEFINING.contains(&pair[0].0) {
                        names.defined.insert(pair[1].0.to_string());
                    }
                }
                // A variant or a field: the line's first name, after `pub`.
                let first = ids
                    .iter()
                    .find(|(w, _, _)| !matches!(*w, "pub" | "crate" | "super" | "in" | "self"));
                if let Some((w, Some(after), _)) = first {
                    if matches!(after, ',' | '{' | '(' | ':' | '=' | ' ') {
                        names.defined.insert(w.to_string());
                    }
                }
                for (w, after, assigned) in &ids {
                    if *after == Some('(') {
                        names.called.insert(w.to_string());
                    }
                    // A protobuf field (`uint64 seqno = 1;`), a binding.
                    if *assigned {
                        names.defined.insert(w.to_string());
                    }
                }
                for piece in line.split('"').skip(1).step_by(2) {
                    let word: String = piece.chars().take_while(|c| is_ident_char(*c)).collect();
                    if !word.is_empty() {
                        names.written.insert(word);
                    }
                }
            }
        }
        names
    }

    /// Whether `cited` (a backticked type or function name) is the code's.
    fn knows(&self, cited: &str) -> bool {
        let call = cited.ends_with("()");
        let path = cited.trim_end_matches("()");
        let first = path.split("::").next().unwrap_or(path);
        let last = path.rsplit("::").next().unwrap_or(path);
        const PRIMITIVE: [&str; 18] = [
            "i8", "i16", "i32", "i64", "i128", "isize", "u8", "u16", "u32", "u64", "u128", "usize",
            "f32", "f64", "bool", "char", "str", "std",
        ];
        PRIMITIVE.contains(&first)
            || self.defined.contains(last)
            || self.imported.contains(last)
            || self.written.contains(last)
            || (call && self.called.contains(last))
    }
}

/// A backticked span that cites a type or a function: a path (`a::B`), a
/// call (`f()`) or a name in CamelCase (`RoundBook`).
fn cites_code(span: &str) -> bool {
    let path = span.trim_end_matches("()");
    let well_formed = !path.is_empty()
        && path.split("::").all(|seg| {
            seg.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && seg.chars().all(is_ident_char)
        });
    let last = path.rsplit("::").next().unwrap_or(path);
    // CamelCase: a capital first, and a capital after a small letter.
    let camel = last.starts_with(|c: char| c.is_ascii_uppercase())
        && last
            .as_bytes()
            .windows(2)
            .any(|w| w[0].is_ascii_lowercase() && w[1].is_ascii_uppercase());
    well_formed && (path.contains("::") || span.ends_with("()") || camel)
}

/// The bare file names of `text` (`secure.rs`, not `src/secure.rs`): a
/// word ending `.rs`, `.proto` or `.wit` with no directory before it.
fn bare_file_names(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for ext in [".rs", ".proto", ".wit"] {
        for (at, _) in text.match_indices(ext) {
            let end = at + ext.len();
            if text[end..].starts_with(|c: char| is_ident_char(c)) {
                continue;
            }
            let start = text[..at]
                .rfind(|c: char| !(is_ident_char(c) || c == '-'))
                .map_or(0, |i| i + 1);
            let before = text[..start].chars().next_back();
            if start < at && !matches!(before, Some('/' | '.' | '*' | '{' | '<' | '$')) {
                out.push(&text[start..end]);
            }
        }
    }
    out
}

/// The documents' (file, name) pairs whose cited type or function name the
/// code does not know, or whose bare file name no tracked file has (see
/// the module docs).
pub fn unknown_names(root: &Path, files: &[String]) -> Vec<(String, String)> {
    let code = CodeNames::read(root, files);
    let base_names: std::collections::HashSet<&str> = files
        .iter()
        .map(|f| f.rsplit('/').next().unwrap_or(f))
        .collect();
    let mut out = Vec::new();
    for file in files
        .iter()
        .filter(|f| f.ends_with(".md") && (!f.contains('/') || f.starts_with("docs/")))
    {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        for span in text.split('`').skip(1).step_by(2) {
            let span = span.trim();
            if cites_code(span) && !code.knows(span) {
                out.push((file.clone(), span.to_string()));
            }
        }
        for name in bare_file_names(&text) {
            if !base_names.contains(name) {
                out.push((file.clone(), name.to_string()));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(file, what)` pairs, one `  file: what` line each.
    fn listed(bad: &[(String, String)]) -> String {
        bad.iter()
            .map(|(f, p)| format!("  {f}: {p}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn tracked_files(root: &Path) -> Vec<String> {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .arg("ls-files")
            .output()
            .expect("git ls-files");
        assert!(out.status.success(), "git ls-files failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect()
    }

    #[test]
    fn every_path_named_in_docs_comments_and_manifests_exists() {
        let root = crate::util::root();
        let files = tracked_files(&root);
        assert!(
            files.len() > 100,
            "git ls-files listed {} files",
            files.len()
        );
        let bad = dangling(&root, &files);
        assert!(
            bad.is_empty(),
            "paths named but missing (file: path):\n{}",
            listed(&bad)
        );
    }

    #[test]
    fn every_name_the_docs_cite_is_the_codes() {
        let root = crate::util::root();
        let files = tracked_files(&root);
        let bad = unknown_names(&root, &files);
        assert!(
            bad.is_empty(),
            "names cited in the docs that the code does not have (file: name):\n{}",
            listed(&bad)
        );
    }

    #[test]
    fn a_name_the_code_lost_is_found_and_a_library_or_a_value_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("src")).unwrap();
        std::fs::create_dir_all(root.join("docs")).unwrap();
        std::fs::write(
            root.join("src/lib.rs"),
            "use tokio::sync::Notify;\npub struct RoundBook {\n    pub pending: u32,\n}\n\
             pub enum Phase {\n    Hydrating,\n}\nfn wait_gone() { let _ = \"IfNotPresent\"; current_exe(); }\n",
        )
        .unwrap();
        std::fs::write(
            root.join("docs/x.md"),
            "`RoundBook`, `RoundBook::pending`, `Phase::Hydrating`, `wait_gone()`, `Notify`,\n\
             `IfNotPresent`, `std::env::current_exe()`, `u64::MAX`, `--flag`, `a b`, lib.rs and\n\
             src/lib.rs; gone: `RoundLedger`, `RoundBook::held`, `wait_stuck()`, `Phase::Switching`,\n\
             secure.rs.\n",
        )
        .unwrap();
        let files = vec!["src/lib.rs".to_string(), "docs/x.md".to_string()];
        let bad: Vec<String> = unknown_names(root, &files)
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        assert_eq!(
            bad,
            vec![
                "Phase::Switching",
                "RoundBook::held",
                "RoundLedger",
                "secure.rs",
                "wait_stuck()"
            ]
        );
    }

    #[test]
    fn a_missing_path_under_any_top_level_directory_is_found_and_patterns_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("crates/a/src")).unwrap();
        std::fs::create_dir_all(root.join("crates/a/tests")).unwrap();
        std::fs::write(root.join("crates/a/Cargo.toml"), "").unwrap();
        std::fs::write(root.join("crates/a/tests/t.rs"), "").unwrap();
        std::fs::create_dir_all(root.join("docs")).unwrap();
        std::fs::write(
            root.join("crates/a/src/lib.rs"),
            "//! see `crates/a/src/gone.rs`, tests/t.rs, crates/*/src and docs/NAME.md,\n\
             //! src/nope.rs, tools/gone.sh; dir.join(\"src/built.rs\") is built.\n",
        )
        .unwrap();
        std::fs::write(root.join("docs/x.md"), "tests/t.rs and docs/missing.md.\n").unwrap();
        std::fs::create_dir_all(root.join("tools")).unwrap();
        std::fs::write(root.join("tools/x.sh"), "").unwrap();
        let files = vec![
            "crates/a/src/lib.rs".to_string(),
            "docs/x.md".to_string(),
            "tools/x.sh".to_string(),
        ];
        assert_eq!(
            dangling(root, &files),
            vec![
                (
                    "crates/a/src/lib.rs".to_string(),
                    "crates/a/src/gone.rs".to_string()
                ),
                ("crates/a/src/lib.rs".to_string(), "src/nope.rs".to_string()),
                (
                    "crates/a/src/lib.rs".to_string(),
                    "tools/gone.sh".to_string()
                ),
                ("docs/x.md".to_string(), "docs/missing.md".to_string()),
            ]
        );
    }
}
