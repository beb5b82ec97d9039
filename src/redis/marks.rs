//! How a process notices that Redis forgot writes it had acknowledged
//! (docs/architecture/redis.md#when-redis-forgets): every reservation advances its shard's sequence
//! (`seq` in the shard's meta), every rebuild gives the shard a new epoch (the fence's id), and
//! each process remembers the highest (epoch, seq) it has seen per shard. Redis answering a
//! lower one has lost writes; the shard is then fenced (`suspect` in its meta) until the
//! activity is rebuilt from PostgreSQL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use deadpool_redis::redis;

use super::{Fences, Shard, StoreError};

/// A shard's (epoch, sequence), ordered epoch first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark {
    pub epoch: i64,
    pub seq: i64,
}

impl Mark {
    /// Takes the (epoch, seq) the reserve script puts after its code off its reply.
    pub(super) fn of_reply(parts: &mut Vec<String>) -> Result<Self, StoreError> {
        if parts.len() < 3 {
            return Err(StoreError::unexpected(format!(
                "reserve script reply too short: {parts:?}"
            )));
        }
        let number = |i: usize, field: &str| {
            parts[i].parse::<i64>().map_err(|_| {
                StoreError::unexpected(format!(
                    "script reply {} with its field {field} not a number: {parts:?}",
                    parts[0]
                ))
            })
        };
        let (epoch, seq) = (number(1, "epoch")?, number(2, "seq")?);
        parts.drain(1..3);
        Ok(Self { epoch, seq })
    }

    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// The highest mark this process has seen per shard.
#[derive(Debug, Clone, Default)]
pub struct Marks(Arc<Mutex<HashMap<Shard, Mark>>>);

impl Marks {
    pub fn seen(&self, shard: Shard) -> Option<Mark> {
        self.0.lock().ok()?.get(&shard).copied()
    }

    /// Remembers `mark` when it is past what was seen.
    pub fn saw(&self, shard: Shard, mark: Mark) {
        if let Ok(mut m) = self.0.lock() {
            let e = m.entry(shard).or_default();
            if mark > *e {
                *e = mark;
            }
        }
    }

    /// Forgets the activity's shards (it ended, or its loss was handled).
    pub fn forget(&self, activity_id: i64) {
        if let Ok(mut m) = self.0.lock() {
            m.retain(|s, _| s.activity_id != activity_id);
        }
    }

    /// Every shard seen, with its mark.
    pub fn all(&self) -> Vec<(Shard, Mark)> {
        self.0
            .lock()
            .map(|m| m.iter().map(|(s, k)| (*s, *k)).collect())
            .unwrap_or_default()
    }
}

/// What a shard's meta says of its trust.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardTrust {
    /// The meta exists at all.
    pub present: bool,
    pub mark: Mark,
    /// Why it is fenced, when it is.
    pub suspect: Option<String>,
}

impl Fences<'_> {
    /// The marks this process has seen (the reserve calls record them).
    pub fn marks(&self) -> &Marks {
        &self.marks
    }

    /// The trust fields of each shard's meta, in one pipeline per slot.
    pub async fn shard_trust(&self, shards: &[Shard]) -> Result<Vec<ShardTrust>, StoreError> {
        let mut out = vec![ShardTrust::default(); shards.len()];
        for group in self.by_slot(shards) {
            let mut pipe = redis::pipe();
            for &i in &group {
                pipe.cmd("HMGET").arg(self.keys.meta(shards[i])).arg(&[
                    "starts_at_ms",
                    "epoch",
                    "seq",
                    "suspect",
                ]);
            }
            let mut conn = self.pool.get().await?;
            type Row = (Option<String>, Option<i64>, Option<i64>, Option<String>);
            let rows: Vec<Row> = pipe.query_async(&mut *conn).await?;
            for (i, (starts, epoch, seq, suspect)) in group.into_iter().zip(rows) {
                out[i] = ShardTrust {
                    present: starts.is_some(),
                    mark: Mark {
                        epoch: epoch.unwrap_or(0),
                        seq: seq.unwrap_or(0),
                    },
                    suspect,
                };
            }
        }
        Ok(out)
    }

    /// Fences every shard of the activity (`buckets` of them): the reserve script answers
    /// FENCED until [`Fences::unfence`]. An existing reason is kept.
    pub async fn fence(
        &self,
        activity_id: i64,
        buckets: u16,
        reason: &str,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let shards: Vec<Shard> = (0..buckets.max(1))
            .map(|b| Shard::new(activity_id, b, buckets))
            .collect();
        for group in self.by_slot(&shards) {
            let mut pipe = redis::pipe();
            for i in group {
                let meta = self.keys.meta(shards[i]);
                pipe.cmd("HSETNX")
                    .arg(&meta)
                    .arg("suspect")
                    .arg(reason)
                    .ignore();
                pipe.cmd("HSETNX")
                    .arg(&meta)
                    .arg("suspect_at_ms")
                    .arg(now_ms)
                    .ignore();
            }
            let mut conn = self.pool.get().await?;
            let () = pipe.query_async(&mut *conn).await?;
        }
        Ok(())
    }

    /// Lifts the fence of one shard after its rebuild: the shard takes `epoch` and resumes
    /// through a ramp of `ramp_ms` starting at `now_ms`.
    pub async fn unfence(
        &self,
        shard: Shard,
        epoch: i64,
        now_ms: i64,
        ramp_ms: u64,
    ) -> Result<(), StoreError> {
        let meta = self.keys.meta(shard);
        let mut conn = self.pool.get().await?;
        let () = redis::pipe()
            .cmd("HSET")
            .arg(&meta)
            .arg("epoch")
            .arg(epoch)
            .arg("resumed_at_ms")
            .arg(now_ms)
            .arg("ramp_ms")
            .arg(ramp_ms)
            .arg("ramp_n")
            .arg(0)
            .ignore()
            .cmd("HDEL")
            .arg(&meta)
            .arg("suspect")
            .arg("suspect_at_ms")
            .ignore()
            .query_async(&mut *conn)
            .await?;
        Ok(())
    }

    /// The positions of `shards` grouped by the pipeline slot they go in (all in one on a
    /// single server).
    fn by_slot(&self, shards: &[Shard]) -> Vec<Vec<usize>> {
        let mut groups: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for (i, s) in shards.iter().enumerate() {
            groups.entry(self.slot(*s)).or_default().push(i);
        }
        groups.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_epoch_outranks_any_sequence() {
        let before = Mark { epoch: 0, seq: 900 };
        let rebuilt = Mark { epoch: 3, seq: 12 };
        assert!(rebuilt > before);
        let marks = Marks::default();
        let s = Shard::from(7);
        marks.saw(s, before);
        marks.saw(s, Mark { epoch: 0, seq: 850 });
        assert_eq!(
            marks.seen(s),
            Some(before),
            "a lower mark never replaces a higher one"
        );
        marks.saw(s, rebuilt);
        assert_eq!(marks.seen(s), Some(rebuilt));
        marks.forget(7);
        assert_eq!(marks.seen(s), None);
    }

    #[test]
    fn the_mark_comes_off_the_reply() {
        let mut parts: Vec<String> = ["SOLD_OUT", "2", "41"].map(String::from).to_vec();
        assert_eq!(
            Mark::of_reply(&mut parts).unwrap(),
            Mark { epoch: 2, seq: 41 }
        );
        assert_eq!(parts, vec!["SOLD_OUT".to_string()]);
        assert!(Mark::of_reply(&mut vec!["OK".to_string()]).is_err());
    }
}
