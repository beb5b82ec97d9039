//! The scenarios' last lines as `make bench` keeps them (`lines/`, one file per scenario),
//! parsed into verdicts and figures for `ratios.rs`' arithmetic.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;

/// One scenario's summary line: `PREFIX [OK|FAILED] key=value ...`.
#[derive(Debug, Clone, Default)]
pub struct Line {
    pub text: String,
    ok: bool,
    fields: HashMap<String, String>,
}

impl Line {
    pub fn parse(text: &str) -> Self {
        let text = text.trim().to_owned();
        let mut words = text.split_whitespace();
        words.next();
        let ok = text.split_whitespace().nth(1) == Some("OK");
        let fields = words
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Line { text, ok, fields }
    }

    /// The scenario passed its own verdict.
    pub fn ok(&self) -> bool {
        self.ok
    }

    /// A figure of the line; `None` when absent or not a number.
    pub fn num(&self, key: &str) -> Option<f64> {
        self.fields.get(key)?.parse().ok()
    }

    /// The HTTP statuses a `wrk` line counted (`s410=…`), with their counts.
    pub fn statuses(&self) -> Vec<(u16, f64)> {
        self.fields
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix('s')?.parse().ok()?, v.parse().ok()?)))
            .collect()
    }

    /// A field as written (`-` when absent), for the summary.
    pub fn raw(&self, key: &str) -> &str {
        self.fields.get(key).map(String::as_str).unwrap_or("-")
    }
}

/// `a / b` to two places; `nan` when either is missing or the baseline is not positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "nan".to_owned(),
    }
}

pub fn sum(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? + b?)
}

/// The scenarios' lines by name, as `scripts/bench.sh` wrote them.
pub struct Lines(pub(crate) HashMap<String, Line>);

impl Lines {
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let mut lines = HashMap::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let text = std::fs::read_to_string(&path)?;
            let last = text.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
            lines.insert(name.to_owned(), Line::parse(last));
        }
        Ok(Lines(lines))
    }

    /// A scenario's line; an empty one (no verdict, no figures) when it never ran.
    pub fn get(&self, name: &str) -> Line {
        self.0.get(name).cloned().unwrap_or_default()
    }

    pub fn num(&self, name: &str, key: &str) -> Option<f64> {
        self.get(name).num(key)
    }
}
