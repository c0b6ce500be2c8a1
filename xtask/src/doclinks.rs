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

#[cfg(test)]
mod tests {
    use super::*;

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
            bad.iter()
                .map(|(f, p)| format!("  {f}: {p}"))
                .collect::<Vec<_>>()
                .join("\n")
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
