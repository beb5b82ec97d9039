//! The rebuild of an activity's Redis state from PostgreSQL, as a plan (pure): from what
//! PostgreSQL recorded and what each shard still holds, the state every shard gets
//! (docs/architecture/redis.md#when-redis-forgets), and what changes.
//!
//! Per shard and SKU, the units held are the recorded reservations that still hold theirs (a
//! valid order; a rejection or cancellation whose release has not run: Redis says whether it
//! ran, since PostgreSQL marks the compensation done only after it) plus the reservations
//! Redis holds that PostgreSQL has not recorded (still in flight). Remaining stock is the
//! bucket's share, plus what the rebalancer moved in, minus what it moved out, minus the units
//! held; the buyers set and the request index are exactly those holders.

use crate::domain::status::{HoldStatus, SendStatus};
use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use crate::domain::ids::{bucket_share, reservation_bucket};
use crate::pg::fences::Recorded;
use crate::redis::{
    RebuildReservation, RebuildShard, RebuildSku, Shard, ShardSnapshot, RESERVATION_TTL_MARGIN_SECS,
};

/// The activity as PostgreSQL defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivityFacts {
    pub activity_id: i64,
    pub starts_at_ms: i64,
    pub ends_at_ms: i64,
    pub valid_ms: i64,
    /// (sku, total stock)
    pub skus: Vec<(i64, i64)>,
    pub buckets: u16,
    /// The activity sells only to sale-pass holders (docs/architecture/hot-path.md#sale-passes).
    pub passes_required: bool,
}

impl ActivityFacts {
    pub fn shards(&self) -> Vec<Shard> {
        let k = self.buckets.max(1);
        (0..k).map(|b| Shard::new(self.activity_id, b, k)).collect()
    }
}

/// What one shard's SKU looks like before and after.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct SkuChange {
    pub bucket: u16,
    pub sku_id: i64,
    /// `None`: the stock hash was gone.
    pub remaining_before: Option<i64>,
    pub remaining_after: i64,
    pub buyers_before: usize,
    pub buyers_after: usize,
    /// Buyers the rebuild puts back (Redis had forgotten them).
    pub buyers_restored: usize,
    /// Buyers Redis held that hold nothing.
    pub buyers_removed: usize,
    /// Units held by reservations Redis has that PostgreSQL has not recorded yet.
    pub in_flight: usize,
}

/// What the rebuild changes, for the dry run, the audit row and the fence's record.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Diff {
    pub skus: Vec<SkuChange>,
    pub requests_before: usize,
    pub requests_after: usize,
    /// Request ids the rebuild puts back (a retry then answers its first reservation).
    pub requests_restored: usize,
    /// Recorded reservations whose hash is written.
    pub reservations_written: usize,
    /// Shards whose meta was gone.
    pub meta_restored: usize,
    /// Inconsistencies the rebuild cannot settle by itself (a bucket holding more units than it
    /// has): each one is logged and reported.
    pub warnings: Vec<String>,
}

impl Diff {
    /// Whether the rebuild changes any count (a resync of a healthy activity changes none).
    pub fn changes_anything(&self) -> bool {
        self.requests_restored > 0
            || self.requests_before != self.requests_after
            || self.meta_restored > 0
            || self.skus.iter().any(|s| {
                s.remaining_before != Some(s.remaining_after)
                    || s.buyers_restored > 0
                    || s.buyers_removed > 0
            })
    }
}

/// The rebuilt state of every shard, and what it changes.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub shards: Vec<RebuildShard>,
    pub diff: Diff,
}

/// One holder of a unit in a shard.
struct Holder {
    reservation_id: String,
    sku_id: i64,
    user_id: String,
    req_field: String,
    /// Not recorded by PostgreSQL yet.
    in_flight: bool,
}

/// Builds the plan (pure: no I/O, `now_ms` given).
pub fn plan(
    facts: &ActivityFacts,
    recorded: &[Recorded],
    snapshots: &[ShardSnapshot],
    now_ms: i64,
) -> Plan {
    let known: HashSet<&str> = recorded.iter().map(|r| r.reservation_id.as_str()).collect();
    let mut out = Plan::default();
    for snap in snapshots {
        let here: Vec<Recorded> = recorded
            .iter()
            .filter(|r| reservation_bucket(&r.reservation_id) == snap.shard.bucket)
            .map(|r| as_redis_left_it(r, snap))
            .collect();
        let here: Vec<&Recorded> = here.iter().collect();
        let holders = holders(&here, snap, &known);
        let mut shard = RebuildShard {
            shard: snap.shard,
            starts_at_ms: facts.starts_at_ms,
            ends_at_ms: facts.ends_at_ms,
            valid_ms: facts.valid_ms,
            passes_required: facts.passes_required,
            ..Default::default()
        };
        for &(sku_id, total) in &facts.skus {
            let (sku, change) =
                plan_sku(facts, snap, (sku_id, total), &holders, &here, &mut out.diff);
            shard.skus.push(sku);
            out.diff.skus.push(change);
        }
        for h in holders.iter().filter(|h| !h.req_field.is_empty()) {
            shard
                .requests
                .entry(h.req_field.clone())
                .or_insert_with(|| h.reservation_id.clone());
        }
        let d = &mut out.diff;
        d.requests_before += snap.requests.len();
        d.requests_after += shard.requests.len();
        d.requests_restored += shard
            .requests
            .iter()
            .filter(|(f, r)| snap.requests.get(*f) != Some(*r))
            .count();
        d.meta_restored += usize::from(!snap.meta_present);
        d.reservations_written += here.len();
        shard.reservations = here
            .iter()
            .map(|r| reservation_hash(facts.activity_id, r, now_ms))
            .collect();
        shard.consumed = here.iter().map(|r| r.reservation_id.clone()).collect();
        out.shards.push(shard);
    }
    out
}

/// A recorded reservation whose compensation is still pending in PostgreSQL holds nothing
/// once Redis shows its release ran (the release comes first, the compensation's DONE after).
fn as_redis_left_it(r: &Recorded, snap: &ShardSnapshot) -> Recorded {
    let mut r = r.clone();
    if r.release_pending && snap.released.contains(&r.reservation_id) {
        r.holds = false;
    }
    r
}

/// The shard's holders: recorded reservations that hold their unit first (where a buyer has
/// both, the order is theirs), then those Redis holds that PostgreSQL has not recorded.
fn holders(here: &[&Recorded], snap: &ShardSnapshot, known: &HashSet<&str>) -> Vec<Holder> {
    let recorded = here.iter().filter(|r| r.holds).map(|r| Holder {
        reservation_id: r.reservation_id.clone(),
        sku_id: r.sku_id,
        user_id: r.user_id.to_string(),
        req_field: format!("{}:{}", r.user_id, r.request_id),
        in_flight: false,
    });
    let in_flight = snap
        .reserved
        .iter()
        .filter(|s| !known.contains(s.reservation_id.as_str()))
        .map(|s| Holder {
            reservation_id: s.reservation_id.clone(),
            sku_id: s.sku_id,
            user_id: s.user_id.clone(),
            req_field: s.req_field.clone(),
            in_flight: true,
        });
    recorded.chain(in_flight).collect()
}

/// One SKU of one shard: its stock, buyers and `taken`, and what changes.
fn plan_sku(
    facts: &ActivityFacts,
    snap: &ShardSnapshot,
    (sku_id, total_pg): (i64, i64),
    holders: &[Holder],
    here: &[&Recorded],
    diff: &mut Diff,
) -> (RebuildSku, SkuChange) {
    let b = snap.shard.bucket;
    let found = snap.skus.iter().find(|s| s.sku_id == sku_id);
    let share = found
        .and_then(|s| s.total)
        .unwrap_or_else(|| bucket_share(total_pg, b, facts.buckets.max(1)));
    let (moved_in, moved_out) = found.map_or((0, 0), |s| (s.moved_in, s.moved_out));
    let mine: Vec<&Holder> = holders.iter().filter(|h| h.sku_id == sku_id).collect();
    let mut buyers: BTreeMap<String, String> = BTreeMap::new();
    for h in &mine {
        buyers
            .entry(h.user_id.clone())
            .or_insert_with(|| h.reservation_id.clone());
    }
    let held = mine.len() as i64;
    let mut remaining = share + moved_in - moved_out - held;
    if remaining < 0 {
        diff.warnings.push(format!(
            "bucket {b} sku {sku_id}: {held} units held but the bucket has {} \
             (share {share}, moved in {moved_in}, out {moved_out}); remaining set to 0",
            share + moved_in - moved_out
        ));
        remaining = 0;
    }
    let before = found.map(|s| &s.buyers);
    let in_flight = mine.iter().filter(|h| h.in_flight).count();
    let change = SkuChange {
        bucket: b,
        sku_id,
        remaining_before: found.and_then(|s| s.remaining),
        remaining_after: remaining,
        buyers_before: before.map_or(0, |m| m.len()),
        buyers_after: buyers.len(),
        buyers_restored: buyers
            .iter()
            .filter(|(u, r)| before.and_then(|m| m.get(*u)) != Some(*r))
            .count(),
        buyers_removed: before.map_or(0, |m| {
            m.iter().filter(|(u, r)| buyers.get(*u) != Some(*r)).count()
        }),
        in_flight,
    };
    let recorded_here = here.iter().filter(|r| r.sku_id == sku_id).count() as i64;
    let sku = RebuildSku {
        sku_id,
        total: share,
        remaining,
        // Past anything an API instance has seen: its sold-out view reads winners again.
        taken: found
            .map_or(0, |s| s.taken)
            .max(recorded_here + in_flight as i64)
            + 1,
        buyers,
    };
    (sku, change)
}

/// The hash of a recorded reservation: its facts, `RESERVED` while it holds its unit,
/// `RELEASED` (with why) otherwise; consumed, so `MQ_SENT`.
fn reservation_hash(activity_id: i64, r: &Recorded, now_ms: i64) -> RebuildReservation {
    let mut fields = vec![
        ("reservation_id", r.reservation_id.clone()),
        ("message_id", r.message_id.clone()),
        ("order_id", r.order_id.clone()),
        ("request_id", r.request_id.clone()),
        ("req_field", format!("{}:{}", r.user_id, r.request_id)),
        ("activity_id", activity_id.to_string()),
        ("sku_id", r.sku_id.to_string()),
        ("user_id", r.user_id.to_string()),
        ("mq_status", SendStatus::MqSent.to_string()),
        ("created_at", r.reserved_at_ms.to_string()),
        ("valid_until", r.valid_until_ms.to_string()),
    ];
    if r.holds {
        fields.push(("status", HoldStatus::Reserved.to_string()));
    } else {
        fields.push(("status", HoldStatus::Released.to_string()));
        fields.push((
            "release_reason",
            r.released_reason
                .clone()
                .unwrap_or_else(|| "REBUILT".to_string()),
        ));
        fields.push(("released_at", now_ms.to_string()));
    }
    // Kept as long as the reserve script keeps a fresh one: validity plus the margin.
    let left_ms = (r.valid_until_ms - now_ms).max(0) as u64;
    RebuildReservation {
        reservation_id: r.reservation_id.clone(),
        fields,
        ttl_secs: left_ms / 1000 + RESERVATION_TTL_MARGIN_SECS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::{SkuSnapshot, Survivor};
    use std::collections::HashMap;

    fn facts(buckets: u16) -> ActivityFacts {
        ActivityFacts {
            activity_id: 5,
            starts_at_ms: 1_000,
            ends_at_ms: 9_000_000,
            valid_ms: 60_000,
            skus: vec![(1, 10)],
            buckets,
            passes_required: false,
        }
    }

    /// Reservation id `n` of activity 5 in `bucket`.
    fn id(bucket: u16, n: u64) -> String {
        let place = if bucket == 0 {
            String::new()
        } else {
            format!(".{bucket}")
        };
        format!("rsv_5{place}_{}", ulid::Ulid::from_parts(n, 0))
    }

    fn rec(rid: &str, user: i64, holds: bool) -> Recorded {
        Recorded {
            reservation_id: rid.to_string(),
            message_id: format!("msg-{rid}"),
            request_id: format!("req-{user}"),
            order_id: format!("ord-{rid}"),
            sku_id: 1,
            user_id: user,
            reserved_at_ms: 2_000,
            valid_until_ms: 62_000,
            holds,
            release_pending: false,
            released_reason: (!holds).then(|| "NO_STOCK".to_string()),
        }
    }

    /// A shard that forgot everything after its first reservation.
    fn forgetful() -> ShardSnapshot {
        ShardSnapshot {
            shard: Shard::from(5),
            meta_present: true,
            skus: vec![SkuSnapshot {
                sku_id: 1,
                total: Some(10),
                remaining: Some(9),
                taken: 1,
                buyers: HashMap::from([("11".to_string(), id(0, 1))]),
                ..Default::default()
            }],
            requests: HashMap::from([("11:req-11".to_string(), id(0, 1))]),
            reserved: vec![],
            released: Default::default(),
            present: 1,
        }
    }

    #[test]
    fn forgotten_holders_come_back_and_the_stock_counts_them() {
        let recorded = vec![
            rec(&id(0, 1), 11, true),
            rec(&id(0, 2), 12, true),
            rec(&id(0, 3), 13, false),
        ];
        let mut snap = forgetful();
        // One reservation PostgreSQL has not seen yet: in flight, it keeps its unit.
        snap.reserved.push(Survivor {
            reservation_id: id(0, 4),
            sku_id: 1,
            user_id: "14".into(),
            req_field: "14:req-14".into(),
        });
        let p = plan(&facts(1), &recorded, &[snap], 10_000);
        let s = &p.shards[0];
        assert_eq!(
            s.skus[0].remaining,
            10 - 3,
            "1, 2 and the one in flight hold units"
        );
        let buyers: Vec<&str> = s.skus[0].buyers.keys().map(String::as_str).collect();
        assert_eq!(
            buyers,
            ["11", "12", "14"],
            "the rejected buyer 13 holds nothing"
        );
        assert_eq!(s.requests.get("12:req-12"), Some(&id(0, 2)));
        assert!(!s.requests.contains_key("13:req-13"));
        assert!(s.skus[0].taken > 1, "past what any instance saw");
        let released = s.reservations.iter().find(|r| r.reservation_id == id(0, 3));
        assert!(released
            .unwrap()
            .fields
            .contains(&("status", HoldStatus::Released.to_string())));
        assert_eq!(s.consumed.len(), 3);
        let d = &p.diff;
        assert_eq!(d.skus[0].remaining_before, Some(9));
        assert_eq!(d.skus[0].buyers_restored, 2);
        assert_eq!(d.requests_restored, 2);
        assert_eq!(d.skus[0].in_flight, 1);
        assert!(d.changes_anything());
    }

    #[test]
    fn a_healthy_activity_is_written_as_it_is() {
        let recorded = vec![rec(&id(0, 1), 11, true)];
        let p = plan(&facts(1), &recorded, &[forgetful()], 10_000);
        assert!(!p.diff.changes_anything(), "{:?}", p.diff);
        assert_eq!(p.shards[0].skus[0].remaining, 9);
    }

    #[test]
    fn a_lost_shard_gets_its_share_and_its_holders() {
        // Bucket 1 of 2 lost every key: its share comes from PostgreSQL's total.
        let lost = ShardSnapshot {
            shard: Shard::new(5, 1, 2),
            ..Default::default()
        };
        let recorded = vec![rec(&id(1, 1), 21, true), rec(&id(0, 2), 22, true)];
        let p = plan(&facts(2), &recorded, &[lost], 10_000);
        let s = &p.shards[0];
        assert_eq!(s.skus[0].total, 5);
        assert_eq!(
            s.skus[0].remaining, 4,
            "only the reservation naming bucket 1 is its"
        );
        assert_eq!(p.diff.meta_restored, 1);
        assert_eq!(p.diff.skus[0].remaining_before, None);
    }

    #[test]
    fn more_holders_than_units_is_reported_not_written_negative() {
        let recorded: Vec<Recorded> = (0..12)
            .map(|i| rec(&id(0, 100 + i as u64), 100 + i, true))
            .collect();
        let p = plan(&facts(1), &recorded, &[forgetful()], 10_000);
        assert_eq!(p.shards[0].skus[0].remaining, 0);
        assert_eq!(p.diff.warnings.len(), 1);
    }

    #[test]
    fn a_cancellation_released_in_redis_before_postgresql_marked_it_done_stays_released() {
        // Two cancelled orders whose compensations are still PENDING in PostgreSQL: the first's
        // release already ran in Redis, the second's has not.
        let mut recorded = vec![
            rec(&id(0, 1), 11, true),
            rec(&id(0, 2), 12, true),
            rec(&id(0, 3), 13, true),
        ];
        for r in &mut recorded[1..] {
            r.release_pending = true;
            r.released_reason = Some("TIMEOUT".to_string());
        }
        let mut snap = forgetful();
        snap.released.insert(id(0, 2));
        let p = plan(&facts(1), &recorded, &[snap], 10_000);
        let s = &p.shards[0];
        assert_eq!(
            s.skus[0].remaining,
            10 - 2,
            "1 holds by its order, 3 until its release runs; 2 was given back"
        );
        assert!(!s.skus[0].buyers.contains_key("12"));
        let status = |n: u64| {
            let r = s.reservations.iter().find(|r| r.reservation_id == id(0, n));
            r.unwrap()
                .fields
                .iter()
                .find(|(f, _)| *f == "status")
                .map(|(_, v)| v.clone())
        };
        assert_eq!(status(2).as_deref(), Some(HoldStatus::Released.as_str()));
        assert_eq!(
            status(3).as_deref(),
            Some(HoldStatus::Reserved.as_str()),
            "its pending release gives it back once"
        );
    }
}
