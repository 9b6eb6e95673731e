//! Strict reading of delimited text files (ratings, triples): one separator per file, detected
//! from the first data line unless given; every data line has the same number of fields; a line
//! that does not parse is an error naming the file and line; a first line is taken as a header
//! only when it looks like one (or when told), and the reader says so.

use std::path::Path;
use std::str::FromStr;

use anyhow::{Context, Result, bail};

/// What separates the fields of a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Separator {
    /// One tab.
    Tab,
    /// One comma.
    Comma,
    /// One semicolon.
    Semicolon,
    /// Runs of spaces or tabs.
    Whitespace,
}

impl Separator {
    /// The separator of a line: a tab if it has one, else a comma, else a semicolon, else
    /// whitespace.
    pub fn detect(line: &str) -> Separator {
        if line.contains('\t') {
            Separator::Tab
        } else if line.contains(',') {
            Separator::Comma
        } else if line.contains(';') {
            Separator::Semicolon
        } else {
            Separator::Whitespace
        }
    }

    /// The fields of `line`, trimmed.
    pub fn split<'l>(&self, line: &'l str) -> Vec<&'l str> {
        match self {
            Separator::Tab => line.split('\t').map(str::trim).collect(),
            Separator::Comma => line.split(',').map(str::trim).collect(),
            Separator::Semicolon => line.split(';').map(str::trim).collect(),
            Separator::Whitespace => line.split_whitespace().collect(),
        }
    }

    /// A name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Separator::Tab => "tab",
            Separator::Comma => "comma",
            Separator::Semicolon => "semicolon",
            Separator::Whitespace => "whitespace",
        }
    }
}

impl FromStr for Separator {
    type Err = String;

    fn from_str(s: &str) -> Result<Separator, String> {
        match s {
            "tab" | "\t" | "\\t" => Ok(Separator::Tab),
            "comma" | "," => Ok(Separator::Comma),
            "semicolon" | ";" => Ok(Separator::Semicolon),
            "space" | "whitespace" | " " => Ok(Separator::Whitespace),
            other => Err(format!("'{other}' is not a separator: use tab, comma, semicolon or space")),
        }
    }
}

/// Whether a file starts with a header line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Header {
    /// Only when the first line looks like one (the reader's test, e.g. [`no_numbers`]).
    #[default]
    Auto,
    /// The first line is a header.
    Yes,
    /// There is none: the first line is data like every other.
    No,
}

/// How to read a delimited file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Format {
    /// The separator; `None`: detected from the first data line.
    pub separator: Option<Separator>,
    /// Header handling.
    pub header: Header,
}

/// One data line: its number (from 1) and fields.
pub struct Row<'l> {
    /// Line number in the file, from 1.
    pub line: usize,
    /// The fields, trimmed.
    pub fields: Vec<&'l str>,
}

/// The usual header test: none of the fields is a number (a data line of ratings has numbers).
pub fn no_numbers(fields: &[&str]) -> bool {
    !fields.iter().any(|f| f.parse::<f64>().is_ok())
}

/// Reads `path` in `format`: every data line must have at least `min_fields` fields, and as many
/// as the first one. `looks_like_header` decides, with [`Header::Auto`], whether the first line
/// is a header. Blank lines and lines starting with `#` are skipped. Calls `row` for every data
/// line; an error it returns is reported with the file and line.
pub fn read(
    path: &Path,
    format: Format,
    min_fields: usize,
    looks_like_header: impl Fn(&[&str]) -> bool,
    mut row: impl FnMut(Row<'_>) -> Result<()>,
) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut separator = format.separator;
    let mut width = None;
    let mut first = true;
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sep = *separator.get_or_insert_with(|| Separator::detect(line));
        let fields = sep.split(line);
        let at = || format!("{}:{line_no}", path.display());
        if std::mem::take(&mut first) {
            let header = match format.header {
                Header::Yes => true,
                Header::No => false,
                Header::Auto => looks_like_header(&fields),
            };
            if header {
                if format.header == Header::Auto {
                    eprintln!("{}: line {line_no} taken as a header: '{line}' (--header or --no-header to say)", path.display());
                }
                continue;
            }
        }
        if fields.len() < min_fields {
            bail!("{}: {} field(s) separated by {}, expected at least {min_fields}: '{line}'", at(), fields.len(), sep.name());
        }
        match width {
            None => width = Some(fields.len()),
            Some(w) if w != fields.len() => {
                bail!(
                    "{}: {} fields separated by {}, but the first data line has {w}: '{line}' (--sep to choose the separator)",
                    at(),
                    fields.len(),
                    sep.name()
                )
            }
            Some(_) => {}
        }
        row(Row { line: line_no, fields }).with_context(at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(text: &str, format: Format) -> Result<Vec<(usize, Vec<String>)>> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ferry-delimited-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.txt");
        std::fs::write(&path, text).unwrap();
        let mut out = Vec::new();
        let result = read(&path, format, 3, no_numbers, |r| {
            r.fields[2].parse::<f64>().map_err(|_| anyhow::anyhow!("'{}' is not a number", r.fields[2]))?;
            out.push((r.line, r.fields.iter().map(|f| f.to_string()).collect()));
            Ok(())
        });
        std::fs::remove_dir_all(&dir).unwrap();
        result.map(|()| out)
    }

    #[test]
    fn one_separator_per_file_and_names_with_spaces() {
        let r = rows("bob,Apollo 13,4\nann,Heat,5\n", Format::default()).unwrap();
        assert_eq!(r[0].1, vec!["bob", "Apollo 13", "4"]);
        let r = rows("1\t2\t3\n4\t5\t6\t77\n", Format::default());
        assert!(r.unwrap_err().to_string().contains(":2: 4 fields"), "every line as wide as the first");
        let r = rows("1 2   3\n4 5 6\n", Format::default()).unwrap();
        assert_eq!(r.len(), 2);
        let r = rows("1;2;3\n", Format { separator: Some(Separator::Comma), header: Header::No });
        assert!(r.is_err(), "a given separator is used as given");
        assert_eq!(rows("1;2;3\n", Format::default()).unwrap().len(), 1);
        assert_eq!("\\t".parse::<Separator>(), Ok(Separator::Tab));
        assert!("|".parse::<Separator>().is_err());
    }

    #[test]
    fn headers_only_when_they_look_like_one() {
        let r = rows("user,item,rating\n1,2,3\n", Format::default()).unwrap();
        assert_eq!(r, vec![(2, vec!["1".into(), "2".into(), "3".into()])]);
        let e = rows("1,2,x\n1,2,3\n", Format::default()).unwrap_err();
        assert!(format!("{e:#}").contains(":1:") && format!("{e:#}").contains("'x' is not a number"), "a malformed first line is an error: {e:#}");
        assert!(rows("user,item,rating\n1,2,3\n", Format { header: Header::No, ..Format::default() }).is_err());
        let r = rows("1,2,3\n4,5,6\n", Format { header: Header::Yes, ..Format::default() }).unwrap();
        assert_eq!(r.len(), 1);
        let e = rows("1,2\n", Format::default()).unwrap_err();
        assert!(e.to_string().contains("expected at least 3"), "{e}");
    }
}
