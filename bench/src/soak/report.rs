//! The soak's verdict: the run's figures from the database's own clocks, what fails the run,
//! and its one summary line.

use super::load::{Load, Paid};
use super::sample::{slope, Sample};
use super::SoakArgs;

/// What the drain and the settle left undone.
pub(super) struct Left {
    pub(super) drained: i64,
    pub(super) settled: i64,
}

/// The run's orders and cancels, from the database's clocks.
pub(super) struct Figures {
    orders: i64,
    create_span: f64,
    order_p99: f64,
    canceled: i64,
    cancel_span: f64,
    cancel_p50: f64,
    cancel_p99: f64,
}

impl Figures {
    pub(super) async fn read(
        pg: &tokio_postgres::Client,
        activity_id: i64,
    ) -> anyhow::Result<Self> {
        let created = pg
            .query_one(
                "SELECT count(*),
                        coalesce(extract(epoch FROM max(c.committed_at) - min(c.committed_at)), 0)::float8,
                        coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                            extract(epoch FROM c.committed_at - o.reserved_at)), 0)::float8
                 FROM orders o JOIN order_commits c USING (xact_id) WHERE o.activity_id = $1",
                &[&activity_id],
            )
            .await?;
        let canceled = pg
            .query_one(
                "SELECT count(*),
                        coalesce(extract(epoch FROM max(canceled_at) - min(canceled_at)), 0)::float8,
                        coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY
                            extract(epoch FROM canceled_at - expires_at)), 0)::float8,
                        coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                            extract(epoch FROM canceled_at - expires_at)), 0)::float8
                 FROM orders WHERE activity_id = $1 AND status = 'CANCELED'",
                &[&activity_id],
            )
            .await?;
        Ok(Self {
            orders: created.get(0),
            create_span: created.get(1),
            order_p99: created.get(2),
            canceled: canceled.get(0),
            cancel_span: canceled.get(1),
            cancel_p50: canceled.get(2),
            cancel_p99: canceled.get(3),
        })
    }
}

/// Everything the verdict reads.
pub(super) struct Verdict<'a> {
    pub(super) args: &'a SoakArgs,
    pub(super) total: usize,
    pub(super) load: &'a Load,
    pub(super) pay: &'a Paid,
    pub(super) left: Left,
    pub(super) figures: &'a Figures,
    pub(super) samples: &'a [Sample],
}

impl Verdict<'_> {
    /// The invariants' `violations` and the run's own, each printed, then the summary line;
    /// whether the run passed.
    pub(super) fn conclude(&self, mut violations: Vec<String>) -> bool {
        violations.extend(self.violations());
        let slopes = self.slopes(&mut violations);
        for v in &violations {
            eprintln!("violation: {v}");
        }
        println!("{}", self.line(&slopes, violations.len()));
        violations.is_empty()
    }

    /// What fails the run besides the invariants (and the memory slopes: [`Verdict::slopes`]).
    fn violations(&self) -> Vec<String> {
        let (args, load, f) = (self.args, self.load, self.figures);
        let mut violations = Vec::new();
        if load.accepted.len() != self.total {
            violations.push(format!(
                "{} of {} reservations accepted (every buyer is new and the stock is ample): refused {:?}, {} without answer",
                load.accepted.len(), self.total, load.refused, load.transport
            ));
        }
        if self.pay.refused > 0 {
            violations.push(format!(
                "{} signed payment notifications refused",
                self.pay.refused
            ));
        }
        if self.left.drained > 0 {
            violations.push(format!(
                "drain incomplete: {} reservations never decided",
                self.left.drained
            ));
        }
        if self.left.settled > 0 {
            violations.push(format!(
                "settle incomplete: {} orders unpaid and uncancelled or compensations pending",
                self.left.settled
            ));
        }
        if f.cancel_p99 > args.max_cancel_p99_secs {
            violations.push(format!(
                "expiry→cancel p99 {:.1} s > {} s",
                f.cancel_p99, args.max_cancel_p99_secs
            ));
        }
        violations
    }

    /// Each process's anonymous memory slope over the last third of the load (`name:MiB/min`),
    /// a violation where it grows faster than allowed.
    fn slopes(&self, violations: &mut Vec<String>) -> Vec<String> {
        let (args, load_secs) = (self.args, self.load.secs);
        let mut slopes = Vec::new();
        for (k, p) in args.procs.iter().enumerate() {
            let points: Vec<(f64, f64)> = self
                .samples
                .iter()
                .filter(|s| s.t >= load_secs * 2.0 / 3.0 && s.t <= load_secs)
                .filter_map(|s| s.anon_mib[k].map(|m| (s.t / 60.0, m)))
                .collect();
            match slope(&points) {
                Some(m) => {
                    slopes.push(format!("{}:{m:.2}", p.name));
                    if m > args.max_rss_slope_mib_per_min {
                        violations.push(format!(
                            "{}: anonymous memory still growing over the last third of the load, {m:.2} MiB/min",
                            p.name
                        ));
                    }
                }
                None => slopes.push(format!("{}:n/a", p.name)),
            }
        }
        slopes
    }

    /// `SOAK OK|FAILED duration_s=… … violations=N`.
    fn line(&self, slopes: &[String], violations: usize) -> String {
        let (args, f) = (self.args, self.figures);
        let per_s = |n: i64, span: f64| if span > 0.0 { n as f64 / span } else { 0.0 };
        // Orders expire at the rate they were created, less the paid share.
        format!(
            "{} {} duration_s={} rate={} requests={} accepted={} orders={} paid={} canceled={} created_per_s={:.0} canceled_per_s={:.0} expired_per_s={:.0} cancel_p50_s={:.2} cancel_p99_s={:.2} order_p99_ms={:.0} api_p99_ms={:.1} rss_slope_mib_per_min={} samples={} violations={}",
            args.summary_prefix,
            if violations == 0 { "OK" } else { "FAILED" },
            args.duration_secs,
            args.rate,
            self.total,
            self.load.accepted.len(),
            f.orders,
            self.pay.paid,
            f.canceled,
            per_s(f.orders, f.create_span),
            per_s(f.canceled, f.cancel_span),
            per_s(f.canceled, f.create_span),
            f.cancel_p50,
            f.cancel_p99,
            f.order_p99 * 1000.0,
            self.load.api_p99_ms,
            slopes.join(","),
            self.samples.len(),
            violations,
        )
    }
}
