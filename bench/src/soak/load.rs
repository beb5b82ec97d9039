//! The soak's two sources of work: the buyers' open loop, and the payer that pays a share of
//! the orders they make.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use tokio::sync::Semaphore;

use super::SoakArgs;
use crate::bench::{one_request, pay_one, Answer, PayAnswer, Planned};
use seckill::config::Settings;

/// What the load's requests came to.
#[derive(Default)]
pub(super) struct Load {
    pub(super) accepted: Vec<String>,
    pub(super) refused: BTreeMap<String, usize>,
    /// Requests with no answer (transport errors and timeouts).
    pub(super) transport: usize,
    /// How long the load took, from the soak's start.
    pub(super) secs: f64,
    /// The p99 from each request's planned start to its answer.
    pub(super) api_p99_ms: f64,
}

/// `total` reservations at `--rate` on a fixed schedule (an open loop), every one from a new
/// buyer, at most `--concurrency` outstanding; returns once every one is answered.
pub(super) async fn open_loop(
    settings: &Settings,
    args: &SoakArgs,
    client: &reqwest::Client,
    base: &str,
    total: usize,
) -> anyhow::Result<Load> {
    let started = Instant::now();
    // Every run's buyers are new: user ids from the clock, far apart between runs.
    let first_user = chrono::Utc::now().timestamp_millis() * 1000;
    let run_tag = format!("s{}", ulid::Ulid::new());
    let answers = Arc::new(Mutex::new(Load::default()));
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let minter = crate::tokens::Minter::new(settings, &args.signing)?;
    tracing::info!(tokens = %minter.label(), "buyers' tokens");
    let slots = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let start = tokio::time::Instant::now();
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / args.rate);
        tokio::time::sleep_until(due).await;
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let user_id = first_user + i as i64;
        let token = minter.mint(user_id)?;
        let p = Planned {
            activity_id: args.activity_id,
            user_id,
            sku_id: args.sku_id,
            request_id: format!("{run_tag}-{i}"),
            auth: Some(format!("Bearer {token}").into()),
        };
        let (client, base, answers, hist) = (
            client.clone(),
            base.to_string(),
            answers.clone(),
            hist.clone(),
        );
        tokio::spawn(async move {
            let answer = one_request(&client, &base, &p).await;
            let us = (due.elapsed().as_micros() as u64).max(1);
            let _ = hist.lock().unwrap().record(us);
            let mut a = answers.lock().unwrap();
            match answer {
                Answer::Accepted { id, .. } => a.accepted.push(id),
                Answer::Refused(code) => *a.refused.entry(code).or_default() += 1,
                Answer::Transport | Answer::Timeout => a.transport += 1,
            }
            drop(slot);
        });
    }
    // Every request answered.
    let _all = slots.acquire_many(args.concurrency.max(1) as u32).await?;
    let mut load = std::mem::take(&mut *answers.lock().unwrap());
    load.secs = started.elapsed().as_secs_f64();
    load.api_p99_ms = hist.lock().unwrap().value_at_quantile(0.99) as f64 / 1000.0;
    eprintln!(
        "soak: load done in {:.0} s: {} accepted, refused {:?}, {} without answer",
        load.secs,
        load.accepted.len(),
        load.refused,
        load.transport
    );
    Ok(load)
}

/// Pays, every second, the unpaid orders of the activity whose hash falls in `share`.
pub(super) struct Payer {
    pub(super) pool: deadpool_postgres::Pool,
    pub(super) client: reqwest::Client,
    pub(super) base: String,
    pub(super) secret: secrecy::SecretBox<str>,
    pub(super) activity_id: i64,
    pub(super) share: f64,
}

/// What the payer's notifications came to.
pub(super) struct Paid {
    pub(super) paid: usize,
    /// Refused for another reason than lateness: a violation.
    pub(super) refused: usize,
    /// Landed after the order's pay window closed: refused (409) as it should be.
    pub(super) late: usize,
}

impl Payer {
    pub(super) fn spawn(
        self,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<Paid> {
        tokio::spawn(async move {
            let mut out = Paid {
                paid: 0,
                refused: 0,
                late: 0,
            };
            while !stop.is_cancelled() {
                // On an overloaded machine the payer can be late: only a refusal that is not
                // lateness counts against the run.
                for answer in self.round().await {
                    match answer {
                        PayAnswer::Paid => out.paid += 1,
                        PayAnswer::Late => out.late += 1,
                        PayAnswer::Refused => out.refused += 1,
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            out
        })
    }

    /// One round: the orders due now, paid 32 at a time.
    async fn round(&self) -> Vec<PayAnswer> {
        let cut = (self.share.clamp(0.0, 1.0) * 1024.0).round() as i32;
        let due: Vec<(String, i64)> = match self.pool.get().await {
            Ok(c) => c
                .query(
                    "SELECT order_id, amount_cents FROM orders
                     WHERE activity_id = $1 AND status = 'CREATED'
                       AND expires_at > now() + interval '2 seconds'
                       AND (hashtext(order_id) & 1023) < $2
                     LIMIT 5000",
                    &[&self.activity_id, &cut],
                )
                .await
                .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        futures::stream::iter(due)
            .map(|(order_id, cents)| async move {
                pay_one(&self.client, &self.base, &self.secret, &order_id, cents).await
            })
            .buffer_unordered(32)
            .collect()
            .await
    }
}
