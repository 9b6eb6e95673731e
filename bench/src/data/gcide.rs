//! The GNU Collaborative International Dictionary of English (GCIDE: Webster's 1913 with parts
//! of WordNet) as a corpus: the dictd database that Debian's `dict-gcide` package ships
//! (`gcide.dict.dz`, gzip-compatible), one entry paragraph per line.
//!
//! Paragraphs are the text between blank lines, their lines joined. Pronunciations
//! (`\La"ri*at\`) and bracketed notes (etymologies, sources like `[1913 Webster]`, accent codes
//! like `[a^]`) are left out: cut into letter runs they would be fragments, not words.

use std::io::Read;

use anyhow::{Context, Result};

/// The most a decompressed database may hold (the 0.48 release is 40 MB): a damaged or foreign
/// archive does not fill the memory.
const MAX_TEXT: u64 = 256 << 20;

/// The corpus of a gzip-compressed dictd database.
pub fn corpus(compressed: &[u8]) -> Result<Vec<u8>> {
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(compressed).take(MAX_TEXT + 1).read_to_end(&mut text).context("decompressing the dictionary")?;
    if text.len() as u64 > MAX_TEXT {
        anyhow::bail!("the dictionary decompresses to more than {} MiB", MAX_TEXT >> 20);
    }
    Ok(paragraphs(&String::from_utf8_lossy(&text)))
}

/// One line per paragraph, without pronunciations and bracketed notes.
fn paragraphs(text: &str) -> Vec<u8> {
    let mut out = String::with_capacity(text.len() / 2);
    let mut paragraph = String::new();
    let flush = |paragraph: &mut String, out: &mut String| {
        let kept = without_notes(paragraph);
        let words: Vec<&str> = kept.split_whitespace().collect();
        if !words.is_empty() {
            out.push_str(&words.join(" "));
            out.push('\n');
        }
        paragraph.clear();
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut paragraph, &mut out);
        } else {
            paragraph.push_str(line);
            paragraph.push(' ');
        }
    }
    flush(&mut paragraph, &mut out);
    out.into_bytes()
}

/// `text` without `\…\` spans and `[…]` spans (nested brackets count; an unclosed one runs to
/// the end of the paragraph).
fn without_notes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut depth, mut in_pronunciation) = (0usize, false);
    for c in text.chars() {
        match c {
            '\\' if depth == 0 => in_pronunciation = !in_pronunciation,
            '[' if !in_pronunciation => depth += 1,
            ']' if !in_pronunciation && depth > 0 => depth -= 1,
            _ if depth == 0 && !in_pronunciation => out.push(if c == '{' || c == '}' { ' ' } else { c }),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_become_lines_without_pronunciations_or_notes() {
        let text = "Largo \\Lar\"go\\, a. & adv. [It., large, L. largus, See {Large}.]\n   (Mus.)\n   Slow or slowly; -- more so than {adagio}.\n   [1913 Webster]\n\n\nLariat \\Lar\"i*at\\ (l[a^]r\"[i^]*[a^]t), n.\n   A long, slender rope.\n";
        let out = String::from_utf8(paragraphs(text)).unwrap();
        assert_eq!(out, "Largo , a. & adv. (Mus.) Slow or slowly; -- more so than adagio .\nLariat (lr\"*t), n. A long, slender rope.\n");
    }

    #[test]
    fn a_gzip_stream_is_read_and_anything_else_is_an_error() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"Word \\Word\\ n.\n  A unit of language. [1913 Webster]\n").unwrap();
        let out = corpus(&gz.finish().unwrap()).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "Word n. A unit of language.\n");
        assert!(corpus(b"not gzip at all").is_err());
    }
}
