//! The reservation attempt (`lua/reserve.lua`): the buyer's request in, the script's decision
//! out, and the lookups of a reservation by its request.

use deadpool_redis::redis::AsyncCommands;

use super::marks::Mark;
use super::{Intake, StoreError, RESERVATION_TTL_MARGIN_SECS};
use crate::domain::order_create::ReservationRef;

/// The reservation as the reserve script reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservationView {
    pub reservation_id: String,
    pub message_id: String,
    pub order_id: String,
    pub mq_status: String,
    pub status: String,
    pub valid_until_ms: i64,
    pub created_at_ms: i64,
}

/// What the reserve script decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveResult {
    Reserved(ReservationView),
    /// The same (user, request_id) was seen before: the earlier reservation, unchanged.
    Duplicate(ReservationView),
    AlreadyPurchased {
        reservation_id: String,
    },
    /// The buyer used this request_id for another SKU of the activity: not a repeat of that
    /// request, and not a new one either. Nothing changed.
    RequestIdReused {
        reservation_id: String,
        sku_id: String,
    },
    SoldOut,
    NotStarted,
    Ended,
    /// The client address's (`by` = "ip") or the buyer's ("u") bucket is empty: a token is
    /// back after `retry_ms`. Nothing changed.
    RateLimited {
        by: String,
        retry_ms: u64,
    },
    /// An operator paused the activity or this SKU, with their reason.
    Paused {
        reason: String,
    },
    NotFound,
    /// The activity is fenced: its Redis state is being rebuilt from PostgreSQL
    /// (docs/architecture/redis.md#when-redis-forgets). Nothing changed.
    Fenced {
        reason: String,
    },
    /// This call found Redis behind what it had answered before (and fenced the shard), or
    /// the activity's keys gone while this process had seen reservations in it. Nothing
    /// changed.
    Lost {
        /// `sequence` (the script found the shard behind) or `meta_missing`.
        signal: &'static str,
        reason: String,
    },
    /// Resuming after a rebuild: this request is not in the share admitted yet (`percent`),
    /// all are again in `secs`.
    Ramp {
        percent: u32,
        secs: u64,
    },
    /// The activity's fair window is open: the request entered the SKU's draw, nothing taken
    /// yet (docs/architecture/hot-path.md#a-fair-start). The view's `valid_until_ms` is when the
    /// window closes; its status is `DRAW_PENDING`.
    Draw(ReservationView),
    /// The window closed at `closes_ms` and the draw is not finished: ask again once it is.
    Drawing {
        closes_ms: i64,
    },
    /// The activity requires a sale pass and the request carried none. Nothing changed.
    PassRequired,
    /// The buyer's pass holds a live reservation of another SKU (`sku_id`). Nothing changed.
    PassUsed {
        reservation_id: String,
        sku_id: String,
    },
}

/// Arguments of one reservation attempt; ids are minted by the caller beforehand.
#[derive(Debug, Clone)]
pub struct ReserveArgs<'a> {
    pub reservation: ReservationRef<'a>,
    pub now_ms: i64,
    pub next_retry_at_ms: i64,
    pub traceparent: &'a str,
    pub valid_secs: u64,
    /// The caller's buckets the script takes a token from first.
    pub limits: RateLimits<'a>,
    /// The buyer's sales channel (`""`: none), kept on the reservation for its re-sends.
    pub channel: &'a str,
    /// The id of the sale pass the caller verified for this buyer and activity (`""`: none;
    /// an activity that requires passes refuses the request).
    pub pass_id: &'a str,
}

/// The abuse limits of one reservation request (docs/architecture/hot-path.md#abuse-limits); a rate
/// of 0 is no limit, and the default is none.
#[derive(Debug, Clone, Copy, Default)]
pub struct RateLimits<'a> {
    /// The client address (`""` when unknown: that bucket is skipped).
    pub client_addr: &'a str,
    pub address_rate_per_sec: f64,
    pub address_burst: u32,
    pub buyer_rate_per_sec: f64,
    pub buyer_burst: u32,
}

/// A reply of the reserve script, read strictly: a missing or malformed field is an error
/// naming the script, its code and the field, never a default.
struct Reply<'a> {
    code: &'a str,
    parts: &'a [String],
}

impl Reply<'_> {
    fn text(&self, i: usize, field: &str) -> Result<String, StoreError> {
        self.parts
            .get(i)
            .cloned()
            .ok_or_else(|| self.bad(field, "missing"))
    }

    fn num<T: std::str::FromStr>(&self, i: usize, field: &str) -> Result<T, StoreError> {
        self.text(i, field)?
            .parse()
            .map_err(|_| self.bad(field, "not a number"))
    }

    fn bad(&self, field: &str, what: &str) -> StoreError {
        StoreError::unexpected(format!(
            "reserve.lua replied {} with its field {field} {what}: {:?}",
            self.code, self.parts
        ))
    }

    /// A time of the reservation; in a repeated request's reply an empty one is a time the
    /// hash does not hold (a draw entry has no validity yet; a hash gone has none): 0.
    fn time(&self, i: usize, field: &str) -> Result<i64, StoreError> {
        if self.code == "DUPLICATE_REQUEST" && self.text(i, field)?.is_empty() {
            return Ok(0);
        }
        self.num(i, field)
    }

    fn view(&self) -> Result<ReservationView, StoreError> {
        Ok(ReservationView {
            reservation_id: self.text(1, "reservation_id")?,
            message_id: self.text(2, "message_id")?,
            order_id: self.text(3, "order_id")?,
            mq_status: self.text(4, "mq_status")?,
            status: self.text(5, "status")?,
            valid_until_ms: self.time(6, "valid_until_ms")?,
            created_at_ms: self.time(7, "created_at_ms")?,
        })
    }
}

impl Intake<'_> {
    /// The atomic reservation: activity open, request idempotency, one per buyer, stock > 0.
    pub async fn reserve(&self, a: &ReserveArgs<'_>) -> Result<ReserveResult, StoreError> {
        let k = &self.keys;
        // The bucket the reservation id names (the caller minted it for the buyer's home).
        let shard = self
            .shard_of(a.reservation.activity_id, a.reservation.reservation_id)
            .await?;
        let seen = self.marks.seen(shard);
        let mut conn = self.pool.get().await?;
        let user = a.reservation.user_id.to_string();
        let mut parts: Vec<String> = self
            .scripts
            .reserve
            .call()
            .key("meta", k.meta(shard))
            .key("sku", k.sku(shard, a.reservation.sku_id))
            .key("buyers", k.buyers(shard, a.reservation.sku_id))
            .key("requests", k.requests(shard))
            .key("pending", k.pending(shard))
            .key("pending_since", k.pending_since(shard))
            .key(
                "address_rate",
                k.rate_bucket(shard, "ip", a.limits.client_addr),
            )
            .key("buyer_rate", k.rate_bucket(shard, "u", &user))
            .key("draw", k.draw(shard, a.reservation.sku_id))
            .key("passes", k.passes_used(shard))
            .arg("now_ms", a.now_ms)
            .arg("user_id", a.reservation.user_id)
            .arg("request_id", a.reservation.request_id)
            .arg("reservation_id", a.reservation.reservation_id)
            .arg("message_id", a.reservation.message_id)
            .arg("order_id", a.reservation.order_id)
            .arg("sku_id", a.reservation.sku_id)
            .arg("activity_id", a.reservation.activity_id)
            .arg("next_retry_at_ms", a.next_retry_at_ms)
            .arg("reservation_prefix", k.reservation_prefix(shard))
            .arg("traceparent", a.traceparent)
            .arg(
                "reservation_ttl_secs",
                a.valid_secs + RESERVATION_TTL_MARGIN_SECS,
            )
            .arg(
                "address_rate",
                if a.limits.client_addr.is_empty() {
                    0.0
                } else {
                    a.limits.address_rate_per_sec
                },
            )
            .arg("address_burst", a.limits.address_burst)
            .arg("buyer_rate", a.limits.buyer_rate_per_sec)
            .arg("buyer_burst", a.limits.buyer_burst)
            .arg("channel", a.channel)
            .arg("seen_epoch", seen.map_or(0, |m| m.epoch))
            .arg("seen_seq", seen.map_or(0, |m| m.seq))
            .arg("pass_id", a.pass_id)
            .arg("buyers_prefix", k.buyers_prefix(shard))
            .invoke_async(&mut *conn)
            .await?;
        drop(conn);
        let mark = Mark::of_reply(&mut parts)?;
        let code = parts.first().map(String::as_str).unwrap_or("");
        if code == "NOT_FOUND" && seen.is_some_and(|m| m.epoch > 0 || m.seq > 0) && mark.is_zero() {
            // The meta that carried the sequence is gone while this process saw reservations
            // in the shard: every key of it may be.
            return Ok(ReserveResult::Lost {
                signal: "meta_missing",
                reason: format!(
                    "the activity's keys are gone from Redis (this process had seen epoch {} seq {})",
                    seen.map_or(0, |m| m.epoch),
                    seen.map_or(0, |m| m.seq)
                ),
            });
        }
        if code != "LOST" {
            self.marks.saw(shard, mark);
        }
        parse_reply(code, &parts)
    }

    /// The activity of an older reservation whose id does not name it (`rsv_<ulid>`), from the
    /// location key earlier versions wrote beside it; read-only, for lookups by id.
    pub async fn legacy_location(&self, reservation_id: &str) -> Result<Option<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.get(self.keys.location(reservation_id)).await?)
    }

    /// The reservation a buyer's request made in the activity, if Redis has it (the request
    /// index that answers a repeated request).
    pub async fn request_reservation(
        &self,
        activity_id: i64,
        user_id: i64,
        request_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let shard = self.home_shard(activity_id, user_id).await?;
        let mut conn = self.pool.get().await?;
        Ok(conn
            .hget(self.keys.requests(shard), format!("{user_id}:{request_id}"))
            .await?)
    }
}

/// The reserve script's reply (code first, the mark already taken off) as a result.
fn parse_reply(code: &str, parts: &[String]) -> Result<ReserveResult, StoreError> {
    let r = Reply { code, parts };
    Ok(match code {
        "OK" => ReserveResult::Reserved(r.view()?),
        "DUPLICATE_REQUEST" => ReserveResult::Duplicate(r.view()?),
        "ALREADY_PURCHASED" => ReserveResult::AlreadyPurchased {
            reservation_id: r.text(1, "reservation_id")?,
        },
        "REQUEST_ID_REUSED" => ReserveResult::RequestIdReused {
            reservation_id: r.text(1, "reservation_id")?,
            sku_id: r.text(2, "sku_id")?,
        },
        "SOLD_OUT" => ReserveResult::SoldOut,
        "NOT_STARTED" => ReserveResult::NotStarted,
        "ENDED" => ReserveResult::Ended,
        "RATE_LIMITED" => ReserveResult::RateLimited {
            by: r.text(1, "by")?,
            retry_ms: r.num(2, "retry_ms")?,
        },
        "PAUSED" => ReserveResult::Paused {
            reason: r.text(1, "reason")?,
        },
        "NOT_FOUND" => ReserveResult::NotFound,
        "FENCED" => ReserveResult::Fenced {
            reason: r.text(1, "reason")?,
        },
        "LOST" => ReserveResult::Lost {
            signal: "sequence",
            reason: r.text(1, "reason")?,
        },
        "PASS_REQUIRED" => ReserveResult::PassRequired,
        "PASS_USED" => ReserveResult::PassUsed {
            reservation_id: r.text(1, "reservation_id")?,
            sku_id: r.text(2, "sku_id")?,
        },
        "DRAW" => ReserveResult::Draw(r.view()?),
        "DRAWING" => ReserveResult::Drawing {
            closes_ms: r.num(1, "closes_ms")?,
        },
        "RAMP" => ReserveResult::Ramp {
            percent: r.num(1, "percent")?,
            secs: r.num(2, "secs")?,
        },
        other => {
            return Err(StoreError::unexpected(format!(
                "reserve script returned an unknown code {other:?}"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_whole_reply_reads_and_a_short_or_malformed_one_names_its_field() {
        let ok = parts(&[
            "OK",
            "rsv",
            "msg",
            "ord",
            "MQ_PENDING",
            "RESERVED",
            "60000",
            "1000",
        ]);
        match parse_reply("OK", &ok).unwrap() {
            ReserveResult::Reserved(v) => {
                assert_eq!((v.valid_until_ms, v.created_at_ms), (60000, 1000))
            }
            other => panic!("{other:?}"),
        }
        let short = parts(&["OK", "rsv", "msg", "ord", "MQ_PENDING", "RESERVED"]);
        let e = parse_reply("OK", &short).unwrap_err().to_string();
        assert!(
            e.contains("reserve.lua replied OK with its field valid_until_ms missing"),
            "{e}"
        );
        let e = parse_reply("RAMP", &parts(&["RAMP", "ten", "1"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("field percent not a number"), "{e}");
        assert!(parse_reply("SOLD_OUT", &parts(&["SOLD_OUT"])).is_ok());
        let gone = parts(&["DUPLICATE_REQUEST", "rsv", "", "", "", "", "", ""]);
        match parse_reply("DUPLICATE_REQUEST", &gone).unwrap() {
            ReserveResult::Duplicate(v) => {
                assert_eq!((v.reservation_id.as_str(), v.valid_until_ms), ("rsv", 0))
            }
            other => panic!("{other:?}"),
        }
    }
}
