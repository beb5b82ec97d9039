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

/// `a / b`; `None` when either is missing or the baseline is not positive.
pub fn quotient(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// `a / b` to two places; `nan` when either is missing or the baseline is not positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    quotient(a, b).map_or_else(|| "nan".to_owned(), |q| format!("{q:.2}"))
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

    /// pgbench's batch the consumer's drain (`B_BATCH`) is compared with: the one measured
    /// right before that drain (`PGBENCH_BATCH`, `run::scenarios::batched_rounds`), or the
    /// limits' own (`LIMITS`) in a run without rounds.
    pub fn batch_floor(&self) -> Line {
        let paired = self.get("PGBENCH_BATCH");
        if paired.num("pgbench_batch_orders_per_s").is_some() {
            paired
        } else {
            self.get("LIMITS")
        }
    }
}

/// Where the median of `values` is (the lower of the two middles for an even count; a value
/// that is not a number counts as the lowest). `None` when there are none.
pub fn median_at(values: &[f64]) -> Option<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    let key = |i: &usize| {
        let v = values[*i];
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v
        }
    };
    order.sort_by(|a, b| key(a).total_cmp(&key(b)));
    order.get(values.len().saturating_sub(1) / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_round_is_the_middle_one_whatever_the_order() {
        assert_eq!(median_at(&[]), None);
        assert_eq!(median_at(&[0.7]), Some(0));
        assert_eq!(median_at(&[0.9, 0.5, 0.7]), Some(2));
        assert_eq!(median_at(&[0.5, 0.9, 0.7, 0.6]), Some(3));
        // A round without a figure is the lowest, never the median of three.
        assert_eq!(median_at(&[f64::NAN, 0.8, 0.6]), Some(2));
    }

    #[test]
    fn a_ratio_needs_both_figures_and_a_positive_baseline() {
        assert_eq!(quotient(Some(8.0), Some(10.0)), Some(0.8));
        assert_eq!(quotient(Some(8.0), Some(0.0)), None);
        assert_eq!(quotient(None, Some(10.0)), None);
        assert_eq!(ratio(Some(8.0), Some(10.0)), "0.80");
        assert_eq!(ratio(Some(8.0), None), "nan");
    }

    #[test]
    fn the_floor_is_the_paired_pgbench_batch_when_there_is_one() {
        let limits = Line::parse("LIMITS pgbench_batch_orders_per_s=10000 pgbench_single_tps=9");
        let paired = Line::parse("LIMITS pgbench_batch_orders_per_s=12000");
        let mut lines = Lines(HashMap::from([("LIMITS".to_owned(), limits)]));
        assert_eq!(
            lines.batch_floor().num("pgbench_batch_orders_per_s"),
            Some(10000.0)
        );
        lines.0.insert("PGBENCH_BATCH".to_owned(), paired);
        assert_eq!(
            lines.batch_floor().num("pgbench_batch_orders_per_s"),
            Some(12000.0)
        );
    }
}
