//! `docs/ENVIRONMENT.md` lists every `FERRY_*` environment variable, checked against the code
//! both ways: a variable that the code, a script or a test reads and the table leaves out fails
//! this test, and so does a row for a variable nothing reads any more.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the repository").to_path_buf()
}

/// Files whose `FERRY_*` names are environment variables: Rust and Python sources, the scripts
/// and CI (C headers name the C API's constants `FERRY_…`, which are not variables).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | "history" | ".git" | "node_modules" | "build") {
                sources(&path, out);
            }
        } else if name.ends_with(".rs")
            || name.ends_with(".py")
            || name.ends_with(".sh")
            || path.parent().is_some_and(|p| p.file_name().is_some_and(|d| d == "scripts" || d == ".ci") || p.ends_with("tests/rxe"))
        {
            out.push(path);
        }
    }
}

/// The `FERRY_*` names in `text` that are used as environment variables: a string that starts
/// with one (`"FERRY_RANK"`, `"FERRY_SECRET_FILE={file}"`), a shell expansion (`$FERRY_RXE`,
/// `${FERRY_RXE:-1}`) or assignment (`FERRY_RXE=0 scripts/setup`).
fn variables_in(text: &str, shell: bool) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(i) = text[at..].find("FERRY_").map(|i| at + i) {
        let end = i + text[i..].find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(text.len() - i);
        let name = &text[i..end];
        let before = if i > 0 { bytes[i - 1] } else { b' ' };
        let before2 = if i > 1 { bytes[i - 2] } else { b' ' };
        let quoted = before == b'"' || (before == b'\'' && !shell);
        let expanded = before == b'$' || (before == b'{' && before2 == b'$');
        let assigned = shell && bytes.get(end) == Some(&b'=') && !before.is_ascii_alphanumeric() && before != b'_' && before != b'-';
        if name.len() > "FERRY_".len() && (quoted || expanded || assigned) {
            found.insert(name.to_string());
        }
        at = end.max(i + 1);
    }
    found
}

#[test]
fn every_environment_variable_is_in_the_table_and_every_row_is_read() {
    let root = root();
    let mut files = Vec::new();
    for dir in ["engine", "transport-tcp", "verbs", "tools", "bench", "tests", "capi", "python", "scripts", ".ci"] {
        sources(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "only {} source files found under {}", files.len(), root.display());
    let mut read = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let shell = !file.extension().is_some_and(|e| e == "rs" || e == "py");
        for name in variables_in(&text, shell) {
            read.insert(name);
        }
    }
    let doc = std::fs::read_to_string(root.join("docs/ENVIRONMENT.md")).unwrap();
    let listed: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(name, _)| name.to_string())
        .filter(|n| n.starts_with("FERRY_"))
        .collect();
    let missing: Vec<&String> = read.difference(&listed).collect();
    let stale: Vec<&String> = listed.difference(&read).collect();
    assert!(missing.is_empty(), "read by the code but not in docs/ENVIRONMENT.md: {missing:?}");
    assert!(stale.is_empty(), "in docs/ENVIRONMENT.md but read nowhere: {stale:?}");
    assert!(listed.len() >= 40, "only {} variables listed", listed.len());
}

#[test]
fn the_scan_finds_variables_in_each_form_and_skips_constants() {
    let rust = r#"std::env::var("FERRY_RANK"); format!("FERRY_SECRET_FILE={file}"); let c = FERRY_OK; sh -c 'echo $FERRY_NODES'"#;
    assert_eq!(variables_in(rust, false).into_iter().collect::<Vec<_>>(), ["FERRY_NODES", "FERRY_RANK", "FERRY_SECRET_FILE"]);
    let shell = "FERRY_RXE=0 scripts/setup\nif [ \"${FERRY_MPI:-1}\" = 0 ]; then echo $FERRY_SLURM; fi\n# see FERRY_DOCS only\nX_FERRY_NOT=1";
    assert_eq!(variables_in(shell, true).into_iter().collect::<Vec<_>>(), ["FERRY_MPI", "FERRY_RXE", "FERRY_SLURM"]);
}
