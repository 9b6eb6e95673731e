//! Benchmark results: a perftest-style table for people, JSON lines for machines.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Whether a larger or a smaller figure is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Latencies.
    Lower,
    /// Throughputs.
    Higher,
}

/// One measured configuration against its baseline from the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// Benchmark name, e.g. `local_pull`.
    pub bench: String,
    /// Its configuration.
    pub config: Value,
    /// Measured figures.
    pub figures: Value,
    /// The headline figure's name among `figures` (compared with the baseline).
    pub headline: String,
    /// Headline value.
    pub value: f64,
    /// Baseline name.
    pub baseline: String,
    /// Baseline value of the same figure.
    pub baseline_value: f64,
    /// `value / baseline_value`.
    pub ratio: f64,
    /// Direction of "better".
    pub better: Better,
    /// The target, in words.
    pub target: String,
    /// Whether the target was met.
    pub met: bool,
}

impl Record {
    /// Prints one JSON line.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).expect("records serialise")
    }
}

fn fmt_num(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Reads a record back from its JSON form (as child processes print them).
pub fn from_json(v: &Value) -> Record {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| Record {
        bench: format!("unreadable record: {e}"),
        config: Value::Null,
        figures: Value::Null,
        headline: String::new(),
        value: f64::NAN,
        baseline: String::new(),
        baseline_value: f64::NAN,
        ratio: f64::NAN,
        better: Better::Higher,
        target: String::new(),
        met: false,
    })
}

/// Prints a benchmark's records: JSON lines with `json`, else a table titled with the command
/// (`ferry-bench NAME [--quick]`) and the time since `started`.
pub fn print_records(name: &str, quick: bool, started: std::time::Instant, json: bool, records: &[Record]) {
    if json {
        for r in records {
            println!("{}", r.json_line());
        }
    } else {
        print_table(&format!("ferry-bench {name}{} — {:.1} s", if quick { " --quick" } else { "" }, started.elapsed().as_secs_f64()), records);
    }
}

/// Prints records as a table.
pub fn print_table(title: &str, records: &[Record]) {
    let line = "-".repeat(118);
    println!("{line}");
    println!(" {title}");
    println!("{line}");
    println!(" {:<22} {:<26} {:>12} {:>14} {:>12} {:>8}  {:<18} met", "benchmark", "configuration", "headline", "value", "baseline", "ratio", "target");
    for r in records {
        let config = config_text(&r.config);
        println!(
            " {:<22} {:<26} {:>12} {:>14} {:>12} {:>8.2}  {:<18} {}",
            r.bench,
            config,
            r.headline,
            fmt_num(r.value),
            fmt_num(r.baseline_value),
            r.ratio,
            r.target,
            if r.met { "yes" } else { "NO" }
        );
        let extra = figures_text(&r.figures, &r.headline);
        if !extra.is_empty() {
            println!("   {:<21} {extra}", "");
        }
    }
    println!("{line}");
}

/// A configuration as `key=value` pairs.
pub fn config_text(v: &Value) -> String {
    match v {
        Value::Object(m) => m.iter().map(|(k, v)| format!("{k}={}", v.to_string().trim_matches('"'))).collect::<Vec<_>>().join(" "),
        other => other.to_string(),
    }
}

fn figures_text(v: &Value, headline: &str) -> String {
    match v {
        Value::Object(m) => m
            .iter()
            .filter(|(k, _)| k.as_str() != headline)
            .map(|(k, v)| format!("{k}={}", v.as_f64().map_or_else(|| v.to_string(), fmt_num)))
            .collect::<Vec<_>>()
            .join("  "),
        _ => String::new(),
    }
}

/// Builds a record, computing ratio and target status.
#[allow(clippy::too_many_arguments)]
pub fn record(bench: &str, config: Value, figures: Value, headline: &str, baseline: &str, baseline_value: f64, better: Better, target: (&str, f64)) -> Record {
    let value = figures.get(headline).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let ratio = if baseline_value > 0.0 { value / baseline_value } else { f64::NAN };
    let (target_text, bound) = target;
    let met = if target_text.is_empty() {
        true
    } else if target_text.starts_with("ratio<=") {
        ratio <= bound
    } else if target_text.starts_with("ratio>=") {
        ratio >= bound
    } else if target_text.starts_with(">=") {
        value >= bound
    } else if target_text.starts_with("<=") {
        value <= bound
    } else {
        true
    };
    Record {
        bench: bench.into(),
        config,
        figures,
        headline: headline.into(),
        value,
        baseline: baseline.into(),
        baseline_value,
        ratio,
        better,
        target: target_text.into(),
        met,
    }
}

/// Merges repeated measurements of one configuration (same benchmark and configuration) into
/// one record: the repetition with the median ratio, plus the spread of the ratios.
pub fn merge_repeats(records: Vec<Record>) -> Vec<Record> {
    let mut groups: Vec<Vec<Record>> = Vec::new();
    for r in records {
        match groups.iter_mut().find(|g| g[0].bench == r.bench && g[0].config == r.config) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|mut g| {
            if g.len() == 1 {
                return g.pop().expect("one");
            }
            g.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
            let (lo, hi, n) = (g[0].ratio, g[g.len() - 1].ratio, g.len());
            let mut median = g.swap_remove(n / 2);
            if let Value::Object(m) = &mut median.figures {
                m.insert("repeats".into(), json!(n));
                m.insert("ratio_min".into(), json!(lo));
                m.insert("ratio_max".into(), json!(hi));
            }
            median
        })
        .collect()
}

/// Summary figures of a latency histogram in nanoseconds.
pub fn latency_figures(h: &hdrhistogram::Histogram<u64>) -> Value {
    json!({
        "p50_ns": h.value_at_quantile(0.5),
        "p99_ns": h.value_at_quantile(0.99),
        "p999_ns": h.value_at_quantile(0.999),
        "mean_ns": (h.mean() * 10.0).round() / 10.0,
        "samples": h.len(),
    })
}
