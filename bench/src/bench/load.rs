//! The load: closed or open loop, each request's answer, and their tally.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::sync::Semaphore;

use super::{BenchArgs, Planned};
use crate::report::{ms, BenchReport};

/// The strict verdict of a sale without injected faults: every request answered, every answer
/// one the sale expects (202, SOLD_OUT, ALREADY_PURCHASED; no 5xx, no throttling, no pause),
/// and exactly the expected number accepted, which is never zero when stock and buyers exist.
pub(super) fn strict_violations(t: &Tally, expected: Option<usize>) -> Vec<String> {
    let mut v = Vec::new();
    if t.transport_errors > 0 {
        v.push(format!("{} requests got no answer", t.transport_errors));
    }
    if !t.other.is_empty() {
        v.push(format!("unexpected answers: {:?}", t.other));
    }
    match expected {
        Some(n) if t.accepted.len() != n => v.push(format!(
            "accepted {} reservations, expected min(stock, distinct buyers) = {n}",
            t.accepted.len()
        )),
        None if t.accepted.is_empty() => v.push("nothing was accepted".into()),
        _ => {}
    }
    v
}

/// Error answers after which the reservation may or may not exist (the API could not tell).
pub(super) const UNKNOWN_OUTCOME: [&str; 3] = ["UNAVAILABLE", "INTERNAL", "UNPARSEABLE"];

#[derive(Default)]
pub(super) struct Tally {
    /// Plan indexes of the requests whose outcome the client cannot know: no answer (a
    /// connection error, a timeout) or a failure past the point of no return.
    pub(super) unknown: Vec<usize>,
    pub(super) accepted: HashSet<String>,
    pub(super) duplicate_requests: usize,
    pub(super) sold_out: usize,
    pub(super) already_purchased: usize,
    pub(super) other: BTreeMap<String, usize>,
    /// Requests without an answer, the timeouts among them.
    pub(super) transport_errors: usize,
    pub(super) timeouts: usize,
}

/// What one reservation request came to.
pub(crate) enum Answer {
    Accepted {
        id: String,
        duplicate: bool,
    },
    /// An error answer, by its stable code.
    Refused(String),
    /// No answer: the connection failed or closed.
    Transport,
    /// No answer before the buyer gave up (`--give-up-ms` from the planned start, or the
    /// client's own timeout).
    Timeout,
}

/// One reservation request of `p` to the API at `base` (its root URL).
pub(crate) async fn one_request(client: &reqwest::Client, base: &str, p: &Planned) -> Answer {
    let body = serde_json::json!({"user_id": p.user_id, "request_id": p.request_id, "quantity": 1});
    let url = format!(
        "{base}/v1/activities/{}/skus/{}/reservations",
        p.activity_id, p.sku_id
    );
    let mut req = client.post(url).json(&body);
    if let Some(auth) = &p.auth {
        req = req.header("authorization", &**auth);
    }
    let resp = req.send().await;
    match resp {
        Err(e) if e.is_timeout() => Answer::Timeout,
        Err(e) => {
            tracing::warn!(request_id = %p.request_id, error = %e, "reservation request without answer");
            Answer::Transport
        }
        Ok(r) => {
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            match (status, v["reservation_id"].as_str()) {
                (202, Some(id)) => Answer::Accepted {
                    id: id.to_owned(),
                    duplicate: v["duplicate"].as_bool() == Some(true),
                },
                _ => Answer::Refused(
                    v["error"]["code"]
                        .as_str()
                        .unwrap_or("UNPARSEABLE")
                        .to_owned(),
                ),
            }
        }
    }
}

pub(super) fn latency_histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

/// The base URLs of `--api` (comma-separated), without a trailing `/`.
pub(super) fn api_bases(api: &str) -> Vec<String> {
    api.split(',')
        .map(|a| a.trim().trim_end_matches('/').to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

/// `concurrency` buyers, each sending its next request when the previous one is answered.
pub(super) async fn closed_loop(
    client: &reqwest::Client,
    bases: &Arc<Vec<String>>,
    plan: &Arc<Vec<Planned>>,
    concurrency: usize,
) -> anyhow::Result<(Histogram<u64>, Vec<(usize, Answer)>)> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.min(plan.len()) {
        let (client, bases, plan, next) =
            (client.clone(), bases.clone(), plan.clone(), next.clone());
        workers.spawn(async move {
            let mut hist = latency_histogram()?;
            let mut answers = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = plan.get(i) else { break };
                let t = Instant::now();
                answers.push((i, one_request(&client, &bases[i % bases.len()], p).await));
                hist.record((t.elapsed().as_micros() as u64).max(1))?;
            }
            anyhow::Ok((hist, answers))
        });
    }
    let mut hist = latency_histogram()?;
    let mut answers = Vec::with_capacity(plan.len());
    while let Some(done) = workers.join_next().await {
        let (h, a) = done??;
        hist.add(&h)?;
        answers.extend(a);
    }
    Ok((hist, answers))
}

/// Requests start on a fixed schedule (`rate` per second) whatever the answers take; at most
/// `max_outstanding` are in flight. Latency counts from the planned start, so time spent
/// waiting for a free slot is part of it (no coordinated omission), and a buyer gives up
/// `give_up` after it: a timeout, whether it was waiting for a slot or for the answer. The
/// histogram holds every request but failed connections; the third value is when the last request was sent
/// (behind the schedule when the generator could not keep up).
pub(super) async fn open_loop(
    client: &reqwest::Client,
    bases: &Arc<Vec<String>>,
    plan: &Arc<Vec<Planned>>,
    rate: f64,
    (max_outstanding, give_up): (usize, Duration),
) -> anyhow::Result<(Histogram<u64>, Vec<(usize, Answer)>, Duration)> {
    let slots = Arc::new(Semaphore::new(max_outstanding.max(1)));
    let mut requests = tokio::task::JoinSet::new();
    let start = tokio::time::Instant::now();
    for i in 0..plan.len() {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due).await;
        let (client, base, plan) = (client.clone(), bases[i % bases.len()].clone(), plan.clone());
        let slots = Arc::clone(&slots);
        requests.spawn(async move {
            let asked = async {
                let _slot = slots.acquire_owned().await;
                one_request(&client, &base, &plan[i]).await
            };
            let answer = tokio::time::timeout_at(due + give_up, asked)
                .await
                .unwrap_or(Answer::Timeout);
            ((due.elapsed().as_micros() as u64).max(1), (i, answer))
        });
    }
    let sent_by = start.elapsed();
    let mut hist = latency_histogram()?;
    let mut answers = Vec::with_capacity(plan.len());
    while let Some(done) = requests.join_next().await {
        let (us, a) = done?;
        // A timeout counts at the moment the buyer gave up (a lower bound on its latency); a
        // failed connection has no latency to speak of.
        if !matches!(a.1, Answer::Transport) {
            hist.record(us)?;
        }
        answers.push(a);
    }
    Ok((hist, answers, sent_by))
}

impl Tally {
    pub(super) fn of(answers: Vec<(usize, Answer)>) -> Self {
        let mut t = Tally::default();
        for (i, a) in answers {
            match a {
                Answer::Transport => {
                    t.transport_errors += 1;
                    t.unknown.push(i);
                }
                Answer::Timeout => {
                    t.transport_errors += 1;
                    t.timeouts += 1;
                    t.unknown.push(i);
                }
                Answer::Accepted { id, duplicate } => {
                    if duplicate {
                        t.duplicate_requests += 1;
                    }
                    t.accepted.insert(id);
                }
                Answer::Refused(code) => match code.as_str() {
                    "SOLD_OUT" => t.sold_out += 1,
                    "ALREADY_PURCHASED" => t.already_purchased += 1,
                    _ => {
                        // A failure past the point of no return may or may not have reserved.
                        if UNKNOWN_OUTCOME.contains(&code.as_str()) {
                            t.unknown.push(i);
                        }
                        *t.other.entry(code).or_default() += 1
                    }
                },
            }
        }
        t
    }
}

/// What the load phase measured.
pub(super) fn load_report(
    args: &BenchArgs,
    t: &Tally,
    hist: &Histogram<u64>,
    elapsed: Duration,
    cpu: Vec<crate::cpu::CpuUse>,
) -> BenchReport {
    BenchReport {
        scenario: args.scenario.clone(),
        mode: if args.rate.is_some() {
            "open"
        } else {
            "closed"
        }
        .into(),
        tokens: "none".into(),
        target_rate: args.rate,
        requests: args.requests,
        accepted: t.accepted.len(),
        duplicate_requests: t.duplicate_requests,
        sold_out: t.sold_out,
        already_purchased: t.already_purchased,
        other_errors: t.other.clone(),
        transport_errors: t.transport_errors,
        timeouts: t.timeouts,
        answers_per_sec: (args.requests - t.transport_errors) as f64 / elapsed.as_secs_f64(),
        elapsed_secs: elapsed.as_secs_f64(),
        requests_per_sec: args.requests as f64 / elapsed.as_secs_f64(),
        accepted_per_sec: t.accepted.len() as f64 / elapsed.as_secs_f64(),
        sold_out_per_sec: t.sold_out as f64 / elapsed.as_secs_f64(),
        api_p50_ms: ms(hist, 0.5),
        api_p99_ms: ms(hist, 0.99),
        api_p999_ms: ms(hist, 0.999),
        api_max_ms: if hist.is_empty() {
            0.0
        } else {
            hist.max() as f64 / 1000.0
        },
        cpu,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::{buyers_per_sku, expected_accepted};
    use super::*;

    fn tally(accepted: usize, other: &[(&str, usize)], transport_errors: usize) -> Tally {
        Tally {
            accepted: (0..accepted).map(|i| format!("rsv_{i}")).collect(),
            other: other.iter().map(|(c, n)| (c.to_string(), *n)).collect(),
            transport_errors,
            ..Tally::default()
        }
    }

    #[test]
    fn a_sale_without_faults_must_accept_exactly_min_stock_and_buyers_per_sku() {
        let plan: Vec<Planned> = [(1, 1), (2, 1), (2, 1), (3, 2), (4, 2), (5, 2)]
            .iter()
            .map(|&(user_id, sku_id)| Planned {
                activity_id: 1,
                user_id,
                sku_id,
                request_id: format!("r{user_id}"),
                auth: None,
            })
            .collect();
        let buyers = buyers_per_sku(&plan);
        assert_eq!(buyers, BTreeMap::from([((1, 1), 2), ((1, 2), 3)]));
        // SKU 1: 2 buyers, 5 units -> 2; SKU 2: 3 buyers, 1 unit -> 1.
        let stock = BTreeMap::from([((1, 1), 5), ((1, 2), 1)]);
        assert_eq!(expected_accepted(&buyers, &stock), 3);
        assert!(strict_violations(&tally(3, &[], 0), Some(3)).is_empty());
        // One short (an answer lost, a buyer turned away) or one too many: both fail.
        assert_eq!(strict_violations(&tally(2, &[], 0), Some(3)).len(), 1);
        assert_eq!(strict_violations(&tally(4, &[], 0), Some(3)).len(), 1);
        // Any 5xx, throttling or pause, or a request without an answer, fails.
        assert_eq!(
            strict_violations(&tally(3, &[("SALE_PAUSED", 1)], 0), Some(3)).len(),
            1
        );
        assert_eq!(strict_violations(&tally(3, &[], 1), Some(3)).len(), 1);
        // Nothing accepted with nothing to compare with is a failure; a sold-out SKU is not.
        assert_eq!(strict_violations(&tally(0, &[], 0), None).len(), 1);
        assert!(strict_violations(&tally(0, &[], 0), Some(0)).is_empty());
    }

    #[test]
    fn several_apis_are_taken_in_turn_without_trailing_slashes() {
        assert_eq!(
            api_bases("http://a:1/, http://b:2"),
            vec!["http://a:1".to_string(), "http://b:2".to_string()]
        );
        assert!(api_bases(" , ").is_empty());
    }
}
