//! A fair start in Redis (docs/architecture/hot-path.md#a-fair-start): an activity's fair window
//! and seed on every stock bucket's meta, and the draw that gives each SKU's stock to its entrants
//! in ticket order once the window closed (`lua/draw.lua`), a chunk at a time.

use super::marks::Mark;
use super::{Draws, Shard, StoreError, RESERVATION_TTL_MARGIN_SECS};

/// Entrants drawn per script call: a large draw never holds Redis long.
pub const DRAW_CHUNK: usize = 2_000;

/// How one SKU's draw in one bucket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrawState {
    /// Every entrant drawn (or the activity has no fair window).
    pub done: bool,
    /// The window is still open: nothing drawn yet.
    pub open: bool,
    pub won: u64,
    pub lost: u64,
    pub entrants: u64,
}

/// `draw_done`, `draw_reported`, `draw_won`, `draw_lost`, `draw_done_at_ms` of a SKU.
type DrawFields = (
    Option<String>,
    Option<String>,
    Option<u64>,
    Option<u64>,
    Option<i64>,
);

/// A finished draw of one SKU in one bucket, for the activity's audit trail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrawReport {
    pub entrants: u64,
    pub won: u64,
    pub lost: u64,
    pub drawn_at_ms: i64,
    pub seed: String,
}

impl Draws<'_> {
    /// The report of a finished draw that nobody has taken yet, taken (`draw_reported` on the
    /// SKU, set once); `None` while it is not finished or once taken. A caller that cannot
    /// record it gives it back with [`Draws::untake_draw_report`].
    pub async fn take_draw_report(
        &self,
        shard: Shard,
        sku_id: i64,
    ) -> Result<Option<DrawReport>, StoreError> {
        let sku = self.keys.sku(shard, sku_id);
        let mut conn = self.pool.get().await?;
        let (done, reported, won, lost, at): DrawFields = redis::cmd("HMGET")
            .arg(&sku)
            .arg("draw_done")
            .arg("draw_reported")
            .arg("draw_won")
            .arg("draw_lost")
            .arg("draw_done_at_ms")
            .query_async(&mut *conn)
            .await?;
        if done.as_deref() != Some("1") || reported.is_some() {
            return Ok(None);
        }
        let taken: bool = redis::cmd("HSETNX")
            .arg(&sku)
            .arg("draw_reported")
            .arg("1")
            .query_async(&mut *conn)
            .await?;
        if !taken {
            return Ok(None);
        }
        let entrants: u64 = redis::cmd("ZCARD")
            .arg(self.keys.draw(shard, sku_id))
            .query_async(&mut *conn)
            .await?;
        let seed: Option<String> = redis::cmd("HGET")
            .arg(self.keys.meta(shard))
            .arg("fair_seed")
            .query_async(&mut *conn)
            .await?;
        Ok(Some(DrawReport {
            entrants,
            won: won.unwrap_or(0),
            lost: lost.unwrap_or(0),
            drawn_at_ms: at.unwrap_or(0),
            seed: seed.unwrap_or_default(),
        }))
    }

    /// Gives back a report taken by [`Draws::take_draw_report`] that could not be recorded.
    pub async fn untake_draw_report(&self, shard: Shard, sku_id: i64) -> Result<(), StoreError> {
        let mut conn = self.pool.get().await?;
        redis::cmd("HDEL")
            .arg(self.keys.sku(shard, sku_id))
            .arg("draw_reported")
            .query_async::<()>(&mut *conn)
            .await?;
        Ok(())
    }

    /// Gives the activity a fair window of `fair_ms` from its start, with `seed` numbering the
    /// tickets (`fair_ms` 0: first come first served). Written to every bucket's meta.
    pub async fn set_fair_start(
        &self,
        activity_id: i64,
        fair_ms: u64,
        seed: &str,
    ) -> Result<(), StoreError> {
        let fields = [
            ("fair_ms", fair_ms.to_string()),
            ("fair_seed", seed.to_string()),
        ];
        self.passes()
            .set_on_every_bucket(activity_id, &fields)
            .await
    }

    /// When an activity's fair window closes (`None`: it has none, or is not warmed).
    pub async fn fair_window_closes(&self, activity_id: i64) -> Result<Option<i64>, StoreError> {
        let mut conn = self.pool.get().await?;
        let (starts, fair): (Option<i64>, Option<i64>) = redis::cmd("HMGET")
            .arg(self.keys.meta(activity_id))
            .arg("starts_at_ms")
            .arg("fair_ms")
            .query_async(&mut *conn)
            .await?;
        Ok(match (starts, fair) {
            (Some(s), Some(f)) if f > 0 => Some(s + f),
            _ => None,
        })
    }

    /// One chunk of the draw of `sku_id` in `shard` at `now_ms`; winners get their first send
    /// due at `next_retry_at_ms` (what no waiting request sends by then, the scanner does).
    pub async fn draw_chunk(
        &self,
        shard: Shard,
        sku_id: i64,
        now_ms: i64,
        next_retry_at_ms: i64,
        valid_secs: u64,
    ) -> Result<DrawState, StoreError> {
        let k = &self.keys;
        let mut conn = self.pool.get().await?;
        let mut parts: Vec<String> = self
            .scripts
            .draw
            .call()
            .key("meta", k.meta(shard))
            .key("sku", k.sku(shard, sku_id))
            .key("buyers", k.buyers(shard, sku_id))
            .key("draw", k.draw(shard, sku_id))
            .key("pending", k.pending(shard))
            .key("pending_since", k.pending_since(shard))
            .arg("now_ms", now_ms)
            .arg("reservation_prefix", k.reservation_prefix(shard))
            .arg("chunk", DRAW_CHUNK)
            .arg("next_retry_at_ms", next_retry_at_ms)
            .arg(
                "reservation_ttl_secs",
                valid_secs + RESERVATION_TTL_MARGIN_SECS,
            )
            .invoke_async(&mut *conn)
            .await?;
        drop(conn);
        let mark = Mark::of_reply(&mut parts)?;
        self.marks.saw(shard, mark);
        let code = parts.first().map(String::as_str).unwrap_or("");
        let num = |i: usize, field: &str| {
            parts.get(i).and_then(|v| v.parse().ok()).ok_or_else(|| {
                StoreError::unexpected(format!(
                    "draw.lua replied {code} with its field {field} missing or not a number: {parts:?}"
                ))
            })
        };
        let state = DrawState {
            done: matches!(code, "DONE" | "NO_DRAW"),
            open: code == "NOT_CLOSED",
            won: num(1, "won")?,
            lost: num(2, "lost")?,
            entrants: num(3, "entrants")?,
        };
        match code {
            "DONE" | "NO_DRAW" | "NOT_CLOSED" | "MORE" => Ok(state),
            "FENCED" => Err(StoreError::unexpected(
                "the activity is fenced: no draw until its rebuild",
            )),
            other => Err(StoreError::unexpected(format!(
                "draw script returned an unknown code {other:?}"
            ))),
        }
    }

    /// Draws `sku_id` in `shard` to the end (chunk after chunk; other callers may be drawing the
    /// same SKU: each chunk is atomic and moves a shared cursor).
    pub async fn draw_all(
        &self,
        shard: Shard,
        sku_id: i64,
        next_retry_at_ms: i64,
        valid_secs: u64,
    ) -> Result<DrawState, StoreError> {
        loop {
            let now = chrono::Utc::now().timestamp_millis();
            let state = self
                .draw_chunk(shard, sku_id, now, next_retry_at_ms, valid_secs)
                .await?;
            if state.done || state.open {
                return Ok(state);
            }
        }
    }
}
