//! The send state of a reservation's message: confirmed (`mark_sent`), uncertain (a re-send
//! scheduled), refused (failed and released), settled from PostgreSQL, and released by the
//! compensation path.

use crate::domain::status::SendStatus;
use deadpool_redis::redis;

use super::{Sends, Shard, StoreError};

/// How often a release a rebuild holds is asked again, and for how long at most.
const HELD_RETRY: std::time::Duration = std::time::Duration::from_millis(50);
const HELD_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// What the release script did with one reservation (its reply, read strictly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Given back now (RESERVED -> RELEASED).
    Now,
    /// Given back before: nothing changed.
    Already,
    /// No such reservation hash: Redis forgot it.
    Missing,
}

impl Released {
    pub const fn as_str(self) -> &'static str {
        match self {
            Released::Now => "RELEASED",
            Released::Already => "ALREADY_RELEASED",
            Released::Missing => "MISSING",
        }
    }

    fn of_reply(reply: &str) -> Result<Self, StoreError> {
        [Released::Now, Released::Already, Released::Missing]
            .into_iter()
            .find(|r| r.as_str() == reply)
            .ok_or_else(|| StoreError::unexpected(format!("release.lua replied {reply:?}")))
    }
}

impl PartialEq<&str> for Released {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Released {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

/// One reservation to give back (the compensation path).
#[derive(Debug, Clone, Copy)]
pub struct Release<'a> {
    pub activity_id: i64,
    pub sku_id: i64,
    pub reservation_id: &'a str,
    pub reason: &'a str,
}

/// A first send the broker confirmed, to record (`Sends::mark_sent_many`).
#[derive(Debug, Clone)]
pub struct SentMark {
    pub activity_id: i64,
    pub reservation_id: String,
    pub message_id: String,
    pub broker_msg_id: String,
    pub sent_at_ms: i64,
}

impl Sends<'_> {
    /// CONFIRMED → MQ_SENT. Returns the script's verdict (`OK`, `MQ_SENT`, `MISSING`, ...).
    pub async fn mark_sent(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        broker_msg_id: &str,
        now_ms: i64,
    ) -> Result<String, StoreError> {
        let now = now_ms.to_string();
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let call = self.sent_call(shard, reservation_id, message_id, broker_msg_id, &now);
        self.invoke(call).await
    }

    /// `mark_sent.lua` for a confirmed send: MQ_SENT with the broker's id and the time, and
    /// into the awaiting index until the scanner sees it consumed.
    pub(super) fn sent_call<'a>(
        &'a self,
        shard: Shard,
        reservation_id: &str,
        message_id: &str,
        broker_msg_id: &str,
        sent_at: &str,
    ) -> redis::ScriptInvocation<'a> {
        self.leave_pending_call(
            shard,
            reservation_id,
            message_id,
            (SendStatus::MqSent.as_str(), sent_at),
            &[("broker_msg_id", broker_msg_id), ("sent_at", sent_at)],
        )
    }

    /// `MQ_PENDING` → `mq_status` with `fields` recorded, out of both pending indexes
    /// (`mark_sent.lua`, a compare-and-set on `message_id`); `status.1` is the score to watch
    /// it by in the awaiting index (`""`: not watched).
    pub(super) fn leave_pending_call(
        &self,
        shard: Shard,
        reservation_id: &str,
        message_id: &str,
        status: (&str, &str),
        fields: &[(&str, &str)],
    ) -> redis::ScriptInvocation<'_> {
        let mut call = self
            .scripts
            .mark_sent
            .call()
            .key("reservation", self.keys.reservation(shard, reservation_id))
            .key("pending", self.keys.pending(shard))
            .key("pending_since", self.keys.pending_since(shard))
            .key("awaiting", self.keys.awaiting(shard))
            .arg("message_id", message_id)
            .arg("reservation_id", reservation_id)
            .arg("mq_status", status.0)
            .arg("awaiting_score", status.1);
        for (field, value) in fields {
            call = call.rest(*field).rest(*value);
        }
        call.done()
    }

    /// Records first sends the broker confirmed, MQ_PENDING → MQ_SENT, in one round trip per
    /// Redis node. Verdicts in order, as `mark_sent`.
    pub async fn mark_sent_many(&self, marks: &[SentMark]) -> Result<Vec<String>, StoreError> {
        let sent_at: Vec<String> = marks.iter().map(|m| m.sent_at_ms.to_string()).collect();
        let mut shards = Vec::with_capacity(marks.len());
        for m in marks {
            shards.push(self.shard_of(m.activity_id, &m.reservation_id).await?);
        }
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = marks
            .iter()
            .zip(&sent_at)
            .zip(&shards)
            .map(|((m, at), &shard)| {
                let call = self.sent_call(
                    shard,
                    &m.reservation_id,
                    &m.message_id,
                    &m.broker_msg_id,
                    at,
                );
                (self.slot(shard), call)
            })
            .collect();
        self.pipelined(&self.scripts.mark_sent, &calls).await
    }

    /// UNKNOWN → stays MQ_PENDING, re-send scheduled; never gives stock back.
    pub async fn schedule_resend(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        next_retry_at_ms: i64,
        error: &str,
    ) -> Result<String, StoreError> {
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(self
            .scripts
            .schedule_resend
            .call()
            .key("reservation", self.keys.reservation(shard, reservation_id))
            .key("pending", self.keys.pending(shard))
            .arg("message_id", message_id)
            .arg("reservation_id", reservation_id)
            .arg("next_retry_at_ms", next_retry_at_ms)
            .arg("error", error)
            .invoke_async(&mut *conn)
            .await?)
    }

    /// DEFINITE_FAILURE → MQ_FAILED and the reservation released once; `UNCERTAIN` (nothing
    /// changed, still MQ_PENDING) when an earlier attempt may have been stored.
    pub async fn mark_failed(
        &self,
        activity_id: i64,
        sku_id: i64,
        reservation_id: &str,
        message_id: &str,
        error: &str,
        now_ms: i64,
    ) -> Result<String, StoreError> {
        let k = &self.keys;
        let shard = self.shard_of(activity_id, reservation_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(self
            .scripts
            .mark_failed
            .call()
            .key("reservation", k.reservation(shard, reservation_id))
            .key("pending", k.pending(shard))
            .key("sku", k.sku(shard, sku_id))
            .key("buyers", k.buyers(shard, sku_id))
            .key("requests", k.requests(shard))
            .key("pending_since", k.pending_since(shard))
            .arg("message_id", message_id)
            .arg("reservation_id", reservation_id)
            .arg("error", error)
            .arg("now_ms", now_ms)
            .invoke_async(&mut *conn)
            .await?)
    }

    /// An uncertain reservation settled from PostgreSQL: out of the pending indexes with
    /// `mq_status` (`MQ_SENT` or `MQ_FENCED`). Returns `OK`, or the status it already had.
    pub async fn settle(
        &self,
        activity_id: i64,
        reservation_id: &str,
        message_id: &str,
        mq_status: &str,
        now_ms: i64,
    ) -> Result<String, StoreError> {
        let now = now_ms.to_string();
        let fields = [("settled_at", now.as_str())];
        let shard = self.shard_of(activity_id, reservation_id).await?;
        // Settled from PostgreSQL: the inbox already decided, nothing left to watch.
        let call =
            self.leave_pending_call(shard, reservation_id, message_id, (mq_status, ""), &fields);
        self.invoke(call).await
    }

    /// Compensation: releases each reservation once, in one round trip (the release script
    /// pipelined). Returns what it did per item, in order.
    /// Items whose shard a rebuild holds are asked again every [`HELD_RETRY`] for at most
    /// [`HELD_WAIT`] (a rebuild holds a shard for the instant it reads and writes it), then
    /// [`StoreError::Held`]: nothing of theirs moved.
    pub async fn release_many(
        &self,
        items: &[Release<'_>],
        now_ms: i64,
    ) -> Result<Vec<Released>, StoreError> {
        let mut shards = Vec::with_capacity(items.len());
        for r in items {
            // The unit goes back to the bucket the reservation took it from.
            shards.push(self.shard_of(r.activity_id, r.reservation_id).await?);
        }
        let mut answers: Vec<Released> = vec![Released::Missing; items.len()];
        let mut left: Vec<usize> = (0..items.len()).collect();
        let waited = std::time::Instant::now();
        loop {
            let got = self.release_once(items, &shards, &left, now_ms).await?;
            let mut held = Vec::new();
            for (i, answer) in left.iter().zip(got) {
                if answer == "HELD" {
                    held.push(*i);
                } else {
                    answers[*i] = Released::of_reply(&answer)?;
                }
            }
            if held.is_empty() {
                return Ok(answers);
            }
            metrics::counter!("redis_release_held_total").increment(held.len() as u64);
            if waited.elapsed() >= HELD_WAIT {
                let r = &items[held[0]];
                return Err(StoreError::Held(format!(
                    "activity {}: {} release(s) waited {HELD_WAIT:?}",
                    r.activity_id,
                    held.len()
                )));
            }
            tokio::time::sleep(HELD_RETRY).await;
            left = held;
        }
    }

    /// One pipelined round of the release script over `items[i]` for each `i` in `which`.
    async fn release_once(
        &self,
        items: &[Release<'_>],
        shards: &[Shard],
        which: &[usize],
        now_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        let k = &self.keys;
        let script = &self.scripts.release;
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = which
            .iter()
            .map(|&i| {
                let (r, shard) = (&items[i], shards[i]);
                let call = script
                    .call()
                    .key("reservation", k.reservation(shard, r.reservation_id))
                    .key("sku", k.sku(shard, r.sku_id))
                    .key("buyers", k.buyers(shard, r.sku_id))
                    .key("requests", k.requests(shard))
                    .key("pending", k.pending(shard))
                    .key("pending_since", k.pending_since(shard))
                    .key("rebuilding", k.rebuilding(shard))
                    .arg("reservation_id", r.reservation_id)
                    .arg("reason", r.reason)
                    .arg("now_ms", now_ms);
                (self.slot(shard), call.done())
            })
            .collect();
        self.pipelined(script, &calls).await
    }
}
