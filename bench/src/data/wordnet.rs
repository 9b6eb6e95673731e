//! WordNet 3.0's database files (`data.noun`, `data.verb`, `data.adj`, `data.adv`, as Debian's
//! `wordnet-base` package ships them) turned into a knowledge graph and a corpus.
//!
//! Each synset is an entity (`lemma.pos.offset`, e.g. `entity.n.00001740`) and each pointer a
//! triple `synset <relation> synset` (117 659 synsets, 26 relations; the lexical pointers between
//! two synsets' words count as relations of the synsets, as in WN18). The glosses are a corpus,
//! one per line. The format is in the `wndb(5WN)` manual page.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};

/// A relation's name for a pointer symbol (the `wninput(5WN)` list).
fn relation(symbol: &str) -> Option<&'static str> {
    Some(match symbol {
        "!" => "antonym",
        "@" => "hypernym",
        "@i" => "instance_hypernym",
        "~" => "hyponym",
        "~i" => "instance_hyponym",
        "#m" => "member_holonym",
        "#s" => "substance_holonym",
        "#p" => "part_holonym",
        "%m" => "member_meronym",
        "%s" => "substance_meronym",
        "%p" => "part_meronym",
        "=" => "attribute",
        "+" => "derivationally_related_form",
        ";c" => "domain_topic",
        "-c" => "member_of_domain_topic",
        ";r" => "domain_region",
        "-r" => "member_of_domain_region",
        ";u" => "domain_usage",
        "-u" => "member_of_domain_usage",
        "*" => "entailment",
        ">" => "cause",
        "^" => "also_see",
        "$" => "verb_group",
        "&" => "similar_to",
        "<" => "participle",
        "\\" => "pertainym",
        _ => return None,
    })
}

/// Satellite adjectives (`s`) live in `data.adj` with the others, and pointers name them `a` or
/// `s` alike: one letter for both keeps one entity per synset.
fn pos_letter(pos: &str) -> Option<char> {
    match pos {
        "n" => Some('n'),
        "v" => Some('v'),
        "a" | "s" => Some('a'),
        "r" => Some('r'),
        _ => None,
    }
}

/// One synset line: its id, its first lemma, its pointers `(symbol, target id)`, its gloss.
struct Synset<'a> {
    id: (char, u32),
    lemma: &'a str,
    pointers: Vec<(&'a str, (char, u32))>,
    gloss: &'a str,
}

/// Parses one line of a data file; `None` for the licence lines at the top (they start with
/// spaces).
fn parse_line(line: &str) -> Result<Option<Synset<'_>>> {
    if line.starts_with(' ') || line.trim().is_empty() {
        return Ok(None);
    }
    let (fields, gloss) = line.split_once(" | ").unwrap_or((line, ""));
    let mut f = fields.split_ascii_whitespace();
    let mut next = |what: &str| f.next().with_context(|| format!("the line ends before its {what}"));
    let offset: u32 = next("offset")?.parse().context("the offset is not a number")?;
    next("lexicographer file")?;
    let pos = pos_letter(next("synset type")?).context("unknown synset type")?;
    let words = usize::from_str_radix(next("word count")?, 16).context("the word count is not hexadecimal")?;
    let mut lemma = "";
    for w in 0..words {
        let word = next("words")?;
        if w == 0 {
            lemma = word;
        }
        next("lexical id")?;
    }
    let count: usize = next("pointer count")?.parse().context("the pointer count is not a number")?;
    let mut pointers = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let symbol = next("pointer symbol")?;
        let target: u32 = next("pointer target")?.parse().context("a pointer's target is not a number")?;
        let target_pos = pos_letter(next("pointer part of speech")?).context("a pointer's part of speech is unknown")?;
        next("pointer source/target")?;
        pointers.push((symbol, (target_pos, target)));
    }
    Ok(Some(Synset { id: (pos, offset), lemma, pointers, gloss: gloss.trim_end() }))
}

fn entity_name(lemma: &str, (pos, offset): (char, u32)) -> String {
    format!("{}.{pos}.{offset:08}", lemma.to_ascii_lowercase())
}

/// The `head<TAB>relation<TAB>tail` lines of the data files' pointers, each distinct triple
/// once, in the files' order. Pointers to a synset that none of the files holds are errors.
pub fn triples(files: &[(String, Vec<u8>)]) -> Result<Vec<u8>> {
    let texts: Vec<(&str, String)> = files.iter().map(|(name, bytes)| (name.as_str(), String::from_utf8_lossy(bytes).into_owned())).collect();
    let mut names = std::collections::HashMap::new();
    let mut synsets = Vec::new();
    for (file, text) in &texts {
        for (n, line) in text.lines().enumerate() {
            let parsed = parse_line(line).with_context(|| format!("{file}, line {}", n + 1))?;
            if let Some(s) = parsed {
                names.insert(s.id, entity_name(s.lemma, s.id));
                synsets.push(s);
            }
        }
    }
    if synsets.is_empty() {
        bail!("no synsets in {}", texts.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(", "));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for s in &synsets {
        for &(symbol, target) in &s.pointers {
            let Some(rel) = relation(symbol) else { bail!("{}: unknown pointer symbol '{symbol}'", names[&s.id]) };
            let Some(tail) = names.get(&target) else { bail!("{}: a pointer to {}{:08}, which no file holds", names[&s.id], target.0, target.1) };
            if seen.insert((s.id, rel, target)) {
                out.extend_from_slice(format!("{}\t{rel}\t{tail}\n", names[&s.id]).as_bytes());
            }
        }
    }
    Ok(out)
}

/// The synsets' glosses (definitions and examples), one line each, in the files' order.
pub fn glosses(files: &[(String, Vec<u8>)]) -> Result<Vec<u8>> {
    gloss_lines(files, false)
}

/// The glosses as `label<TAB>gloss` lines: 1 for a noun's, 0 for any other synset's.
pub fn labelled_glosses(files: &[(String, Vec<u8>)]) -> Result<Vec<u8>> {
    gloss_lines(files, true)
}

fn gloss_lines(files: &[(String, Vec<u8>)], labelled: bool) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for (file, bytes) in files {
        for (n, line) in String::from_utf8_lossy(bytes).lines().enumerate() {
            if let Some(s) = parse_line(line).with_context(|| format!("{file}, line {}", n + 1))?
                && !s.gloss.is_empty()
            {
                if labelled {
                    out.extend_from_slice(if s.id.0 == 'n' { b"1\t" } else { b"0\t" });
                    out.extend_from_slice(s.gloss.replace('\t', " ").as_bytes());
                } else {
                    out.extend_from_slice(s.gloss.as_bytes());
                }
                out.push(b'\n');
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOUNS: &str = "  1 This software and database is being provided to you, the LICENSEE, by  \n\
00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 ~ 00002137 n 0000 ~ 00002137 n 0000 | that which is perceived or known  \n\
00001930 03 n 01 physical_entity 0 002 @ 00001740 n 0000 + 00002000 v 0101 | an entity that has physical existence  \n\
00002137 03 n 02 abstraction 0 abstract_entity 0 001 @ 00001740 n 0000 | a general concept  \n";
    const VERBS: &str = "00002000 29 v 01 be 0 001 + 00001930 n 0101 01 + 02 00 | have the quality of being; \"John is rich\"  \n";

    fn files() -> Vec<(String, Vec<u8>)> {
        vec![("data.noun".into(), NOUNS.as_bytes().to_vec()), ("data.verb".into(), VERBS.as_bytes().to_vec())]
    }

    #[test]
    fn pointers_become_distinct_triples_between_named_synsets() {
        let text = String::from_utf8(triples(&files()).unwrap()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "entity.n.00001740\thyponym\tphysical_entity.n.00001930",
                "entity.n.00001740\thyponym\tabstraction.n.00002137",
                "physical_entity.n.00001930\thypernym\tentity.n.00001740",
                "physical_entity.n.00001930\tderivationally_related_form\tbe.v.00002000",
                "abstraction.n.00002137\thypernym\tentity.n.00001740",
                "be.v.00002000\tderivationally_related_form\tphysical_entity.n.00001930",
            ],
            "the repeated pointer is one triple; verb frames after the pointers are ignored"
        );
    }

    #[test]
    fn glosses_are_one_line_per_synset() {
        let text = String::from_utf8(glosses(&files()).unwrap()).unwrap();
        assert_eq!(text.lines().count(), 4);
        assert!(text.starts_with("that which is perceived or known\n"));
        // Labelled by part of speech: three nouns, then the verb.
        let labelled = String::from_utf8(labelled_glosses(&files()).unwrap()).unwrap();
        let labels: Vec<&str> = labelled.lines().map(|l| l.split('\t').next().unwrap()).collect();
        assert_eq!(labels, ["1", "1", "1", "0"]);
        assert!(labelled.starts_with("1\tthat which is perceived or known\n"));
    }

    #[test]
    fn damaged_files_are_errors_not_panics() {
        let bad = |text: &str| triples(&[("data.noun".into(), text.as_bytes().to_vec())]).unwrap_err().to_string();
        assert!(bad("00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | cut short\n").contains("line 1"));
        assert!(bad("00001740 03 n zz entity 0 000 | bad count\n").contains("line 1"));
        let e = triples(&[("data.noun".into(), b"00001740 03 n 01 entity 0 001 ~ 00009999 n 0000 | dangling\n".to_vec())]).unwrap_err();
        assert!(e.to_string().contains("no file holds"), "{e}");
        let e = triples(&[("data.noun".into(), b"00001740 03 n 01 entity 0 001 ?? 00001740 n 0000 | odd\n".to_vec())]).unwrap_err();
        assert!(e.to_string().contains("unknown pointer symbol"), "{e}");
        assert!(triples(&[("data.noun".into(), b"  licence only\n".to_vec())]).is_err());
        // A count that claims a huge number of pointers runs out of fields instead of allocating.
        assert!(bad("00001740 03 n 01 entity 0 999999999 | x\n").contains("line 1"));
    }
}
