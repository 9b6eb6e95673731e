//! Strict reading of delimited text files (ratings, triples): one separator per file, detected
//! from the first data line unless given; every data line has the same number of fields; a line
//! that does not parse is an error naming the file and line; a first line is taken as a header
//! only when it looks like one (or when told), and the reader says so (once per process and
//! file, and not in processes that leave it to another: [`leave_notices_to_others`]).
//!
//! Tab-, comma- and semicolon-separated files are read by the `csv` crate, as spreadsheets and
//! pandas write them: quoted fields (with separators, doubled quotes or line breaks inside), a
//! byte-order mark, CRLF line ends. Whitespace-separated files are split on runs of blanks.

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

    /// The separator as written between fields (a space for whitespace).
    pub fn text(&self) -> &'static str {
        match self {
            Separator::Tab => "\t",
            Separator::Comma => ",",
            Separator::Semicolon => ";",
            Separator::Whitespace => " ",
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

impl Format {
    /// This format for a file known to start with a header (the built-in RecBole files), unless
    /// the user said otherwise: no notice that it was taken as one.
    pub fn with_known_header(self) -> Format {
        match self.header {
            Header::Auto => Format { header: Header::Yes, ..self },
            _ => self,
        }
    }
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
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let Some(first) = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with('#')) else {
        return Ok(());
    };
    let separator = format.separator.unwrap_or_else(|| Separator::detect(first));
    let mut rows = Rows { path, format, min_fields, looks_like_header, separator, width: None, first: true };
    let byte = match separator {
        Separator::Whitespace => {
            for (index, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let fields: Vec<&str> = line.split_whitespace().collect();
                if rows.is_data(index + 1, &fields)? {
                    row(Row { line: index + 1, fields }).with_context(|| format!("{}:{}", path.display(), index + 1))?;
                }
            }
            return Ok(());
        }
        Separator::Tab => b'\t',
        Separator::Comma => b',',
        Separator::Semicolon => b';',
    };
    let mut reader =
        csv::ReaderBuilder::new().delimiter(byte).has_headers(false).flexible(true).trim(csv::Trim::All).comment(Some(b'#')).from_reader(text.as_bytes());
    let mut record = csv::StringRecord::new();
    let mut lines = LineCounter { text: text.as_bytes(), at: 0, line: 1 };
    loop {
        match reader.read_record(&mut record) {
            Ok(false) => return Ok(()),
            Ok(true) => {}
            Err(e) => bail!("{}: {e}", path.display()),
        }
        let line_no = lines.line_of(record.position().map_or(0, |p| p.byte() as usize));
        let fields: Vec<&str> = record.iter().collect();
        if fields.iter().all(|f| f.is_empty()) {
            continue;
        }
        if fields.iter().any(|f| f.contains('\n')) {
            // No name of a user, item, entity or relation holds a line break: a quoted field
            // that swallowed the lines after it is a quote left open.
            bail!("{}:{line_no}: a quoted field runs on over the following lines (a quote left open?)", path.display());
        }
        if rows.is_data(line_no, &fields)? {
            row(Row { line: line_no, fields }).with_context(|| format!("{}:{line_no}", path.display()))?;
        }
    }
}

/// The line numbers of the csv reader's records. It gives a record's position as where the
/// previous record ended, before the line end, blank lines and comments it skipped (and its
/// own line count leaves those out), so the counter walks the text from there to the record.
struct LineCounter<'t> {
    text: &'t [u8],
    /// How far the text is counted, and the line there.
    at: usize,
    line: usize,
}

impl LineCounter<'_> {
    /// The line on which the record found at or after byte `from` starts.
    fn line_of(&mut self, from: usize) -> usize {
        let text = self.text;
        let from = from.clamp(self.at, text.len());
        self.line += text[self.at..from].iter().filter(|&&b| b == b'\n').count();
        let mut i = from;
        loop {
            match text.get(i) {
                Some(b'\n') => self.line += 1,
                Some(b'\r') => {}
                Some(b'#') if i == 0 || text[i - 1] == b'\n' => match text[i..].iter().position(|&b| b == b'\n') {
                    Some(end) => {
                        i += end;
                        self.line += 1;
                    }
                    None => i = text.len(),
                },
                _ => break,
            }
            i += 1;
        }
        self.at = i.min(text.len());
        self.line
    }
}

/// What the reader checks line by line: the header, the fields' count.
struct Rows<'p, H> {
    path: &'p Path,
    format: Format,
    min_fields: usize,
    looks_like_header: H,
    separator: Separator,
    /// The first data line's number of fields.
    width: Option<usize>,
    first: bool,
}

impl<H: Fn(&[&str]) -> bool> Rows<'_, H> {
    /// Whether the line is data (not the header), or why it is wrong.
    fn is_data(&mut self, line_no: usize, fields: &[&str]) -> Result<bool> {
        let shown = || fields.join(if self.separator == Separator::Whitespace { " " } else { self.separator.text() });
        if std::mem::take(&mut self.first) {
            let header = match self.format.header {
                Header::Yes => true,
                Header::No => false,
                Header::Auto => (self.looks_like_header)(fields),
            };
            if header {
                if self.format.header == Header::Auto {
                    notice_header(self.path, line_no, &shown());
                }
                return Ok(false);
            }
        }
        let at = || format!("{}:{line_no}", self.path.display());
        if fields.len() < self.min_fields {
            bail!("{}: {} field(s) separated by {}, expected at least {}: '{}'", at(), fields.len(), self.separator.name(), self.min_fields, shown());
        }
        match self.width {
            None => self.width = Some(fields.len()),
            Some(w) if w != fields.len() => {
                bail!(
                    "{}: {} fields separated by {}, but the first data line has {w}: '{}' (--sep to choose the separator)",
                    at(),
                    fields.len(),
                    self.separator.name(),
                    shown()
                )
            }
            Some(_) => {}
        }
        Ok(true)
    }
}

/// Whether this process leaves notices about the files it reads to another, which reads the
/// same files: a cluster's ranks other than 0, or every rank of one that `ferry train` started
/// (it has told already).
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Leaves the notices about the files this process reads (a line taken as a header) to another
/// process that reads the same files.
pub fn leave_notices_to_others() {
    QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Says once per process and file that a line was taken as a header (unless another process
/// says it: [`leave_notices_to_others`]).
fn notice_header(path: &Path, line_no: usize, line: &str) {
    static TOLD: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());
    if QUIET.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let mut told = TOLD.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if told.iter().any(|p| p == path) {
        return;
    }
    told.push(path.to_path_buf());
    eprintln!("{}: line {line_no} taken as a header: '{line}' (--header or --no-header to say)", path.display());
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
    fn quoted_fields_byte_order_marks_and_crlf_as_spreadsheets_write_them() {
        let r = rows("\u{feff}user,item,rating\r\n\"user 1\",\"Movie, quoted\",4\r\n\"say \"\"hi\"\"\",x,5\r\n", Format::default()).unwrap();
        assert_eq!(r[0], (2, vec!["user 1".to_string(), "Movie, quoted".to_string(), "4".to_string()]), "the header, BOM and all, is skipped");
        assert_eq!(r[1].1[0], "say \"hi\"", "doubled quotes inside a quoted field");
        let r = rows("# a comment\n\n1\t\"a\tb\"\t3\n\n4\tc\t6\n", Format::default()).unwrap();
        assert_eq!(r, vec![(3, vec!["1".into(), "a\tb".into(), "3".into()]), (5, vec!["4".into(), "c".into(), "6".into()])], "line numbers count every line");
        let e = rows("1,\"open,3\n4,5,6\n7,8,9\n", Format::default()).unwrap_err();
        assert!(e.to_string().contains(":1: a quoted field runs on"), "{e}");
        let e = rows("1,2,3\n4,\"5\",6,7\n", Format::default()).unwrap_err();
        assert!(e.to_string().contains(":2: 4 fields separated by comma, but the first data line has 3"), "{e}");
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
