//! Every metric a role records is described (`telemetry::METRICS`: its `# HELP` line), once,
//! as the kind it is recorded as; the alert rules name only metrics that exist.

use std::collections::HashMap;
use std::path::Path;

use seckill::telemetry::{Kind, METRICS};

/// `(kind, name, file)` of every metric recorded with a literal name under `dir`.
fn recorded(dir: &Path, out: &mut Vec<(Kind, String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            recorded(&path, out);
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (macro_name, kind) in [
            ("counter!(", Kind::Counter),
            ("gauge!(", Kind::Gauge),
            ("histogram!(", Kind::Histogram),
        ] {
            for (at, _) in text.match_indices(macro_name) {
                // Not `describe_counter!(`: only the recording macros.
                if text[..at].ends_with('_') {
                    continue;
                }
                let rest = text[at + macro_name.len()..].trim_start();
                let Some(rest) = rest.strip_prefix('"') else {
                    continue;
                };
                let name: String = rest.chars().take_while(|c| *c != '"').collect();
                out.push((kind, name, path.display().to_string()));
            }
        }
    }
}

#[test]
fn every_recorded_metric_is_described_once_as_its_kind() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seen = Vec::new();
    recorded(&root.join("src"), &mut seen);
    assert!(
        seen.len() > 50,
        "the scan found only {} metrics",
        seen.len()
    );
    let mut described: HashMap<&str, Kind> = HashMap::new();
    for m in METRICS {
        assert!(!m.help.is_empty(), "{} has no description", m.name);
        assert!(
            described.insert(m.name, m.kind).is_none(),
            "{} is described twice",
            m.name
        );
    }
    let mut missing = Vec::new();
    for (kind, name, file) in &seen {
        match described.get(name.as_str()) {
            None => missing.push(format!("{name} ({file})")),
            Some(k) => assert_eq!(k, kind, "{name} is recorded as a {kind:?} in {file}"),
        }
    }
    assert!(
        missing.is_empty(),
        "recorded but not described: {missing:?}"
    );
}

/// The `expr:` values of a rules file, a block scalar (`expr: |`) with its indented lines.
fn expressions(rules: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut block: Option<usize> = None;
    for line in rules.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(at) = block {
            if line.trim().is_empty() || indent > at {
                if let Some(last) = out.last_mut() {
                    last.push_str(line);
                    last.push('\n');
                }
                continue;
            }
            block = None;
        }
        if let Some(value) = line.trim_start().strip_prefix("expr:") {
            out.push(value.to_string());
            if matches!(value.trim(), "|" | ">" | "|-" | ">-") {
                block = Some(indent);
            }
        }
    }
    out
}

#[test]
fn the_alert_rules_name_only_metrics_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = std::fs::read_to_string(root.join("config/prometheus/alerts.yml")).unwrap();
    let known: Vec<&str> = METRICS.iter().map(|m| m.name).collect();
    let mut unknown = Vec::new();
    let exprs = expressions(&rules);
    assert_eq!(exprs.len(), rules.matches("expr:").count());
    let mut checked = 0;
    for expr in exprs {
        // Label values (`topic="order_create"`) are not metric names.
        let unquoted: String = expr.split('"').step_by(2).collect::<Vec<_>>().join(" ");
        for word in unquoted.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(word);
            let project_metric = [
                "mq_",
                "reservation_",
                "order_",
                "outbox_",
                "pg_",
                "http_",
                "admission_",
                "refund_",
            ]
            .iter()
            .any(|p| base.starts_with(p));
            if project_metric {
                checked += 1;
                if !known.contains(&base) {
                    unknown.push(base.to_string());
                }
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} metric names read from the rules"
    );
    unknown.sort();
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "alert rules name unknown metrics: {unknown:?}"
    );
}
