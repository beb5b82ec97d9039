//! When Redis forgets (docs/architecture/redis.md#when-redis-forgets): a process that sees an
//! activity's Redis state behind what it answered raises a fence ([`raise`]): every shard of
//! the activity refuses new reservations (503 SALE_PAUSED) and PostgreSQL records it. The
//! scanner ([`Resync::pass`]) then waits until every message sent before the fence has been
//! consumed, rebuilds the activity's Redis state from PostgreSQL ([`plan`]), and lifts the
//! fence with a new epoch, resuming through the ramp. `seckill activity resync` runs the same
//! rebuild on an operator's word.

mod fence;
pub mod plan;
mod watch;

pub use fence::{activity_facts, actor, raise};
pub use watch::watch_marks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::Utc;
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::config::Settings;
use crate::mq::LagProbe;
use crate::pg::fences::{self, Fence};
use crate::redis::RedisStore;
use plan::Diff;

/// What one rebuild did.
#[derive(Debug, Clone, Serialize)]
pub struct Rebuilt {
    pub activity_id: i64,
    /// Whether the rebuild changes (or changed) any count: a healthy activity's does not.
    pub changes: bool,
    pub diff: Diff,
    /// Passes needed: a pass that read for longer than its hold allows starts over.
    pub attempts: u32,
    pub rebuild_secs: f64,
    pub written: bool,
}

/// How many times a rebuild starts over when it read for longer than its hold allows.
const REBUILD_ATTEMPTS: u32 = 3;

/// How long a rebuild holds the scripts that move the activity's stock (a compensation's
/// release, a leftover move): they wait while it reads and writes. A rebuild that read for
/// longer than the hold less [`HOLD_MARGIN`] does not write, and starts over.
const STOCK_HOLD: Duration = Duration::from_secs(10);
const HOLD_MARGIN: Duration = Duration::from_secs(3);

/// The rebuild: PostgreSQL's reservations and each shard's state read, the plan written
/// (`write`) or only reported.
pub struct Resync {
    pub settings: Arc<Settings>,
    pub pg: deadpool_postgres::Pool,
    pub redis: RedisStore,
    /// Where the consumers' progress is read; `None`: the drain is not checked (the operator's
    /// `--no-drain-check`).
    pub probe: Option<Arc<LagProbe>>,
    pub by: String,
}

impl Resync {
    /// The rebuilt state of the activity, written when `write`.
    ///
    /// Orders, payments and cancellations go on committing while it runs (only reservations
    /// are fenced). What changes a shard's stock besides a reservation runs through a script
    /// that a rebuild can hold: before reading, the shards are held ([`crate::redis::Rebuild::hold_stock`]),
    /// so no release lands between the read and the write, and each shard's write lets them
    /// go. A cancellation committed in PostgreSQL meanwhile is written as holding its unit, and
    /// its release, held until then, gives the unit back once. Nothing PostgreSQL commits can
    /// make the plan stale, so the rebuild does not start over for it.
    pub async fn rebuild(&self, activity_id: i64, write: bool) -> anyhow::Result<Rebuilt> {
        let started = Instant::now();
        let client = self.pg.get().await?;
        let facts = activity_facts(&**client, activity_id)
            .await?
            .with_context(|| format!("activity {activity_id} is not in PostgreSQL"))?;
        let shards = facts.shards();
        for attempt in 1..=REBUILD_ATTEMPTS {
            if write {
                self.redis.rebuild().hold_stock(&shards, STOCK_HOLD).await?;
            }
            let pass = self.rebuild_once(&client, &facts, write).await;
            if write && !matches!(pass, Ok(Some(_))) {
                // Gave up before writing every shard: the stock moves again at once.
                if let Err(e) = self.redis.rebuild().unhold_stock(&shards).await {
                    warn!(activity_id, error = %e, "rebuild hold left to its lease");
                }
            }
            let Some(plan) = pass? else {
                continue;
            };
            for w in &plan.diff.warnings {
                warn!(activity_id, warning = %w, "rebuild");
            }
            return Ok(Rebuilt {
                activity_id,
                changes: plan.diff.changes_anything(),
                diff: plan.diff,
                attempts: attempt,
                rebuild_secs: started.elapsed().as_secs_f64(),
                written: write,
            });
        }
        anyhow::bail!(
            "activity {activity_id}: {REBUILD_ATTEMPTS} rebuilds each read for longer than \
             {STOCK_HOLD:?} less {HOLD_MARGIN:?}"
        )
    }

    /// One pass: both stores read, the plan made and (when `write`) written; `None` when the
    /// read outlasted what the hold allows (nothing written).
    async fn rebuild_once(
        &self,
        client: &tokio_postgres::Client,
        facts: &plan::ActivityFacts,
        write: bool,
    ) -> anyhow::Result<Option<plan::Plan>> {
        let held = Instant::now();
        let skus: Vec<i64> = facts.skus.iter().map(|(s, _)| *s).collect();
        // Redis first: a reservation recorded between the two reads is then counted once, as
        // PostgreSQL's; a release that ran before the hold shows in Redis.
        let mut snapshots = Vec::new();
        for shard in facts.shards() {
            snapshots.push(self.redis.rebuild().snapshot_shard(shard, &skus).await?);
        }
        let recorded = fences::recorded(client, facts.activity_id).await?;
        let plan = plan::plan(facts, &recorded, &snapshots, Utc::now().timestamp_millis());
        // A large activity's long read, in the fault tests: the sale's writes commit meanwhile.
        fail::fail_point!("rebuild-before-write");
        if !write {
            return Ok(Some(plan));
        }
        if held.elapsed() + HOLD_MARGIN > STOCK_HOLD {
            warn!(
                activity_id = facts.activity_id,
                read_secs = held.elapsed().as_secs_f64(),
                "rebuild read for longer than its hold allows: again"
            );
            return Ok(None);
        }
        for shard in &plan.shards {
            self.redis.rebuild().write_shard(shard).await?;
        }
        Ok(Some(plan))
    }

    /// Every message sent for the activity before the fence (and in the sends' own time
    /// after it) is consumed into PostgreSQL: the order-create group has taken its topic up
    /// to then, and its retry topic is caught up.
    pub async fn drained(&self, fence: &Fence) -> anyhow::Result<bool> {
        if fence.drained_at.is_some() {
            return Ok(true);
        }
        let mq = &self.settings.mq;
        // A send under way when the fence went up stores its message within its timeout.
        let grace_ms = (mq.send_timeout_ms + 1000) as i64;
        let since_ms = fence.detected_at.timestamp_millis() + grace_ms;
        if Utc::now().timestamp_millis() < since_ms {
            return Ok(false);
        }
        let Some(probe) = &self.probe else {
            return Ok(true);
        };
        let names = self.settings.names();
        let (group, topic) = (&names.order_create_group, &names.order_create_topic);
        if probe.taken_until_ms(group, topic).await? < since_ms {
            return Ok(false);
        }
        let retry = crate::mq::lag::retry_topic(group);
        match probe.taken_until_ms(group, &retry).await {
            Ok(t) if t < since_ms => return Ok(false),
            Ok(_) => {}
            // Created at a group's first failed delivery: none yet is nothing to wait for.
            Err(e) => debug!(error = %e, "retry topic not read; taken as empty"),
        }
        let client = self.pg.get().await?;
        fences::mark_drained(&**client, fence.fence_id).await?;
        Ok(true)
    }

    /// Rebuilds the fenced activity and lifts its fence: each shard takes the fence's id as its
    /// epoch and resumes through the ramp. One process at a time per activity (an advisory
    /// lock); `None` when another holds it, or closed the fence already.
    pub async fn rebuild_and_resume(&self, fence: &Fence) -> anyhow::Result<Option<Rebuilt>> {
        let lock = self.pg.get().await?;
        let key = fence.activity_id;
        let got: bool = lock
            .query_one(
                "SELECT pg_try_advisory_lock(hashtext('seckill.resync'), $1::int4)",
                &[&(key as i32)],
            )
            .await?
            .get(0);
        if !got {
            return Ok(None);
        }
        // Still open? Another process may have finished it before this one got the lock.
        let open = fences::open_of(&**lock, key).await?.map(|f| f.fence_id);
        let result = if open == Some(fence.fence_id) {
            Some(self.rebuild_and_resume_locked(fence).await)
        } else {
            None
        };
        let _ = lock
            .execute(
                "SELECT pg_advisory_unlock(hashtext('seckill.resync'), $1::int4)",
                &[&(key as i32)],
            )
            .await;
        let Some(r) = result else {
            return Ok(None);
        };
        let label = if r.is_ok() { "ok" } else { "failed" };
        metrics::counter!("redis_rebuild_total", "result" => label).increment(1);
        r.map(Some)
    }

    async fn rebuild_and_resume_locked(&self, fence: &Fence) -> anyhow::Result<Rebuilt> {
        let activity_id = fence.activity_id;
        let client = self.pg.get().await?;
        let facts = activity_facts(&**client, activity_id)
            .await?
            .with_context(|| format!("activity {activity_id} is not in PostgreSQL"))?;
        let now_ms = Utc::now().timestamp_millis();
        // A crash after an earlier pass lifted the fence and before it closed in PostgreSQL
        // left the shards open: closed again for this pass.
        self.redis
            .fences()
            .fence(
                activity_id,
                facts.buckets,
                "rebuilding from PostgreSQL",
                now_ms,
            )
            .await?;
        let rebuilt = self.rebuild(activity_id, true).await?;
        metrics::histogram!("redis_rebuild_duration_seconds").record(rebuilt.rebuild_secs);
        let ramp_ms = self.settings.api.resume_ramp_secs * 1000;
        let now_ms = Utc::now().timestamp_millis();
        for shard in facts.shards() {
            self.redis
                .fences()
                .unfence(shard, fence.fence_id, now_ms, ramp_ms)
                .await?;
        }
        let record = serde_json::to_value(&rebuilt)?;
        let fenced_secs = fences::close(&**client, fence.fence_id, &record).await?;
        metrics::histogram!("redis_fence_duration_seconds").record(fenced_secs);
        info!(
            activity_id,
            fence_id = fence.fence_id,
            fenced_secs,
            rebuild_secs = rebuilt.rebuild_secs,
            attempts = rebuilt.attempts,
            requests_restored = rebuilt.diff.requests_restored,
            reservations_written = rebuilt.diff.reservations_written,
            "activity rebuilt from PostgreSQL: reservations resume through the ramp"
        );
        Ok(rebuilt)
    }

    /// Shards fenced in Redis with no open fence in PostgreSQL (the process that fenced them
    /// died before recording it): recorded now.
    async fn adopt_flags(&self) -> anyhow::Result<()> {
        // Every warmed activity's shards in one read (one pipeline per slot).
        let mut shards = Vec::new();
        for activity_id in self.redis.activities().await? {
            shards.extend(self.redis.shards(activity_id).await?);
        }
        let trust = self.redis.fences().shard_trust(&shards).await?;
        let mut flagged: Vec<(i64, String)> = Vec::new();
        for (shard, t) in shards.iter().zip(trust) {
            if let Some(reason) = t.suspect {
                if !flagged.iter().any(|(a, _)| *a == shard.activity_id) {
                    flagged.push((shard.activity_id, reason));
                }
            }
        }
        for (activity_id, reason) in flagged {
            let client = self.pg.get().await?;
            if fences::open_of(&**client, activity_id).await?.is_none() {
                drop(client);
                raise(
                    &self.pg,
                    &self.redis,
                    activity_id,
                    "suspect_flag",
                    &reason,
                    &self.by,
                )
                .await?;
            }
        }
        Ok(())
    }

    /// One pass of the scanner's loop: fences found only in Redis recorded; each open fence
    /// whose activity has drained rebuilt and lifted.
    pub async fn pass(&self) -> anyhow::Result<usize> {
        self.adopt_flags().await?;
        let open = {
            let client = self.pg.get().await?;
            fences::open_fences(&**client).await?
        };
        metrics::gauge!("redis_fenced_activities").set(open.len() as f64);
        let mut resumed = 0;
        for fence in &open {
            if !self.drained(fence).await? {
                continue;
            }
            match self.rebuild_and_resume(fence).await {
                Ok(Some(_)) => resumed += 1,
                Ok(None) => {}
                Err(e) => warn!(activity_id = fence.activity_id, fence_id = fence.fence_id,
                                error = %format!("{e:#}"), "rebuild failed; tried again next pass"),
            }
        }
        if resumed > 0 {
            let client = self.pg.get().await?;
            let left = fences::open_fences(&**client).await?.len();
            metrics::gauge!("redis_fenced_activities").set(left as f64);
        }
        Ok(resumed)
    }
}

/// Runs [`Resync::pass`] every `every` until `stop`.
pub async fn run_loop(resync: Resync, every: Duration, stop: tokio_util::sync::CancellationToken) {
    while !stop.is_cancelled() {
        if let Err(e) = resync.pass().await {
            warn!(error = %format!("{e:#}"), "resync pass failed");
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
