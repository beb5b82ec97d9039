//! What a role's `/metrics` (Prometheus text) said: a histogram's buckets summed over the
//! series that match some labels, the difference of two readings, and a quantile read from it
//! the way Prometheus's `histogram_quantile` does (linear within the bucket). The bench reads
//! each stage's figures from the roles themselves this way (docs/architecture/observability.md).

/// One reading of a role's `/metrics`; empty when the role did not answer.
#[derive(Debug, Clone, Default)]
pub struct Scrape(String);

impl Scrape {
    pub async fn of(url: &str) -> Scrape {
        let text = match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        Scrape(text)
    }

    #[cfg(test)]
    pub fn from_text(text: &str) -> Scrape {
        Scrape(text.to_owned())
    }

    /// The cumulative buckets `(le, count)` of histogram `name`, summed over the series whose
    /// labels include every `(label, value)` of `matching`, in `le` order (`+Inf` last).
    pub fn buckets(&self, name: &str, matching: &[(&str, &str)]) -> Buckets {
        let bucket = format!("{name}_bucket");
        let mut out: Vec<(f64, f64)> = Vec::new();
        for (metric, labels, value) in self.samples() {
            if metric != bucket || !matching.iter().all(|m| labels.contains(m)) {
                continue;
            }
            let Some(le) = labels.iter().find(|(k, _)| *k == "le") else {
                continue;
            };
            let le: f64 = match le.1 {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or(f64::NAN),
            };
            match out.iter_mut().find(|(b, _)| *b == le) {
                Some(slot) => slot.1 += value,
                None => out.push((le, value)),
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        Buckets(out)
    }

    /// The largest value of gauge `name` over the series matching `matching`.
    pub fn gauge_max(&self, name: &str, matching: &[(&str, &str)]) -> Option<f64> {
        self.samples()
            .filter(|(m, labels, _)| *m == name && matching.iter().all(|x| labels.contains(x)))
            .map(|(_, _, v)| v)
            .reduce(f64::max)
    }

    /// `(metric, labels, value)` of every sample line.
    fn samples(&self) -> impl Iterator<Item = (&str, Vec<(&str, &str)>, f64)> {
        self.0.lines().filter_map(|line| {
            if line.starts_with('#') || line.trim().is_empty() {
                return None;
            }
            let (head, value) = line.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (metric, labels) = match head.split_once('{') {
                Some((m, rest)) => (m, labels(rest.trim_end_matches('}'))),
                None => (head, Vec::new()),
            };
            Some((metric, labels, value))
        })
    }
}

/// `a="x",b="y"` into pairs (label values here never hold a quote or a comma).
fn labels(text: &str) -> Vec<(&str, &str)> {
    text.split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.trim(), v.trim().trim_matches('"')))
        })
        .collect()
}

/// A histogram's cumulative buckets `(le, count)`, `le` ascending.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(Vec<(f64, f64)>);

impl Buckets {
    /// What was observed between `before` and `self` (a role's counters only grow).
    pub fn since(&self, before: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(le, n)| {
                    let was = before.0.iter().find(|(b, _)| *b == le).map_or(0.0, |b| b.1);
                    (le, (n - was).max(0.0))
                })
                .collect(),
        )
    }

    pub fn count(&self) -> f64 {
        self.0.last().map_or(0.0, |b| b.1)
    }

    /// The `q` quantile, linear within its bucket; a quantile in the `+Inf` bucket is the
    /// largest finite bound (a lower bound). `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, n) in &self.0 {
            if n >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let inside = n - below;
                let share = if inside > 0.0 {
                    (rank - below) / inside
                } else {
                    1.0
                };
                return Some(lower + (le - lower) * share);
            }
            (lower, below) = (le, n);
        }
        Some(lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# TYPE pg_pool_wait_seconds histogram
pg_pool_wait_seconds_bucket{pool="a",le="0.001"} 90
pg_pool_wait_seconds_bucket{pool="a",le="0.01"} 99
pg_pool_wait_seconds_bucket{pool="a",le="+Inf"} 100
pg_pool_wait_seconds_bucket{pool="b",le="0.001"} 10
pg_pool_wait_seconds_bucket{pool="b",le="0.01"} 10
pg_pool_wait_seconds_bucket{pool="b",le="+Inf"} 10
pg_pool_wait_seconds_count{pool="a"} 100
mq_consumer_lag_seconds{topic="order_create"} 4.5
mq_consumer_lag_seconds{topic="order_timeout"} 9
"#;

    #[test]
    fn buckets_sum_the_matching_series_and_quantiles_interpolate_within_a_bucket() {
        let s = Scrape::from_text(TEXT);
        let all = s.buckets("pg_pool_wait_seconds", &[]);
        assert_eq!(all.count(), 110.0);
        let a = s.buckets("pg_pool_wait_seconds", &[("pool", "a")]);
        assert_eq!(a.count(), 100.0);
        // Rank 50 of 100 lies in the first bucket (0..1 ms): half way up it.
        assert!((a.quantile(0.5).unwrap() - 0.000_555).abs() < 1e-5);
        // Rank 99 is the last of the second bucket: its upper bound.
        assert!((a.quantile(0.99).unwrap() - 0.01).abs() < 1e-9);
        // Rank 99.9 lies past every finite bound: the largest finite bound.
        assert_eq!(a.quantile(0.999), Some(0.01));
        assert_eq!(s.buckets("absent", &[]).quantile(0.5), None);
    }

    #[test]
    fn a_difference_keeps_only_what_was_observed_between_two_readings() {
        let before = Scrape::from_text(TEXT).buckets("pg_pool_wait_seconds", &[("pool", "a")]);
        let after = Scrape::from_text(&TEXT.replace("} 100", "} 120").replace("} 99", "} 119"))
            .buckets("pg_pool_wait_seconds", &[("pool", "a")]);
        let d = after.since(&before);
        assert_eq!(d.count(), 20.0);
        // All 20 new ones in 1-10 ms: rank 10 half way up that bucket.
        assert!((d.quantile(0.5).unwrap() - 0.0055).abs() < 1e-9);
        let s = Scrape::from_text(TEXT);
        assert_eq!(s.gauge_max("mq_consumer_lag_seconds", &[]), Some(9.0));
        assert_eq!(
            s.gauge_max("mq_consumer_lag_seconds", &[("topic", "order_create")]),
            Some(4.5)
        );
    }
}
