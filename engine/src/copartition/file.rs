//! The plan file: text, so that it can be read and diffed.
//!
//! ```text
//! ferry-plan 1
//! nodes 4
//! keys 262145
//! examples 3722
//! batch 32
//! data 5be7c0e4a1d2f3b9
//! homes
//! 2            one line per key: its home
//! …
//! examples
//! 0            one line per example: its node
//! …
//! end
//! ```
//!
//! A reader checks every line against the header and the header against the limits before it
//! trusts a count, and grows its arrays as lines arrive (never by a count the file claims).

use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use super::Plan;
use crate::error::{Error, Result};
use crate::placement::Placement;

const MAGIC: &str = "ferry-plan 1";
/// Most examples a plan holds.
const MAX_EXAMPLES: u64 = 1 << 32;

impl Plan {
    /// Writes the plan to `path` (see the module documentation for the format).
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| Error::Config(format!("writing the plan {}: {e}", path.display()));
        let mut out = BufWriter::new(std::fs::File::create(path).map_err(io)?);
        writeln!(
            out,
            "{MAGIC}\nnodes {}\nkeys {}\nexamples {}\nbatch {}\ndata {:016x}\nhomes",
            self.nodes(),
            self.placement.keys(),
            self.examples.len(),
            self.batch,
            self.data_digest
        )
        .map_err(io)?;
        for h in self.placement.homes() {
            writeln!(out, "{h}").map_err(io)?;
        }
        writeln!(out, "examples").map_err(io)?;
        for n in &self.examples {
            writeln!(out, "{n}").map_err(io)?;
        }
        writeln!(out, "end").map_err(io)?;
        out.flush().map_err(io)
    }

    /// Reads a plan that [`Plan::write`] wrote, refusing anything else with the file's name,
    /// the line and what is wrong.
    pub fn read(path: &Path) -> Result<Plan> {
        let file = std::fs::File::open(path).map_err(|e| Error::Config(format!("reading the plan {}: {e}", path.display())))?;
        Plan::parse(std::io::BufReader::new(file)).map_err(|e| Error::Config(format!("the plan {}: {e}", path.display())))
    }

    /// Reads a plan from `input`; errors name the line.
    pub fn parse(input: impl BufRead) -> std::result::Result<Plan, String> {
        let mut lines = input.lines().enumerate().map(|(i, l)| (i + 1, l));
        let mut read = 0;
        let mut next = move || -> std::result::Result<(usize, String), String> {
            match lines.next() {
                Some((n, Ok(l))) => {
                    read = n;
                    Ok((n, l.trim().to_string()))
                }
                Some((n, Err(e))) => Err(format!("line {n}: {e}")),
                None => Err(format!("it ends after line {read}, before its `end` line: it was cut short")),
            }
        };
        let (_, magic) = next()?;
        if magic != MAGIC {
            return Err(format!("line 1 is '{}', not '{MAGIC}': not a plan of `ferry partition`", clip(&magic)));
        }
        let mut header = |name: &str, max: u64| -> std::result::Result<u64, String> {
            let (n, line) = next()?;
            let value =
                line.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).ok_or_else(|| format!("line {n}: expected `{name} …`, found '{}'", clip(&line)))?;
            let parsed = if name == "data" { u64::from_str_radix(value, 16).ok() } else { value.parse::<u64>().ok() };
            parsed.filter(|v| *v <= max).ok_or_else(|| format!("line {n}: {name} '{}' is not a number up to {max}", clip(value)))
        };
        let nodes = header("nodes", u16::MAX as u64)?;
        let keys = header("keys", Placement::MAX_KEYS)?;
        let examples = header("examples", MAX_EXAMPLES)?;
        let batch = header("batch", u32::MAX as u64)?;
        let digest = header("data", u64::MAX)?;
        if nodes == 0 || keys == 0 || batch == 0 {
            return Err("nodes, keys and batch must be at least 1".into());
        }
        let mut section = |name: &str, count: u64, into: &mut Vec<u16>| -> std::result::Result<(), String> {
            let (n, line) = next()?;
            if line != name {
                return Err(format!("line {n}: expected `{name}`, found '{}'", clip(&line)));
            }
            for _ in 0..count {
                let (n, line) = next()?;
                match line.parse::<u16>() {
                    Ok(node) if (node as u64) < nodes => into.push(node),
                    _ => return Err(format!("line {n}: '{}' is not a node of 0..{nodes} (the {name} section holds {count} lines)", clip(&line))),
                }
            }
            Ok(())
        };
        let (mut homes, mut assigned) = (Vec::new(), Vec::new());
        section("homes", keys, &mut homes)?;
        section("examples", examples, &mut assigned)?;
        let (n, last) = next()?;
        if last != "end" {
            return Err(format!("line {n}: expected `end` after {examples} examples, found '{}': the counts in the header are wrong", clip(&last)));
        }
        let placement = Placement::new(nodes as usize, homes).map_err(|e| e.to_string())?;
        Ok(Plan { examples: assigned, placement: Arc::new(placement), batch: batch as usize, data_digest: digest })
    }
}

fn clip(s: &str) -> &str {
    &s[..s.floor_char_boundary(60)]
}
