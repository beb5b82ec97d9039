//! The fast lane (docs/architecture/roles.md#the-fast-lane): while the order consumer is behind,
//! reservations that would expire before their turn are rejected and compensated ahead of the
//! queue, so valid ones do not age behind doomed ones.
//!
//! The backlog's age is read from the messages themselves: a listener call whose oldest
//! message was accepted by Redis `consumer.fast_lane_backlog_ms` ago or more means the
//! consumer is at least that far behind. In such a call, every message with less than
//! `consumer.fast_lane_margin_ms` of its validity left (or none) goes to one transaction of
//! its own ([`crate::pg::order_tx::shed`]) that runs ahead of the batches
//! ([`crate::services::batch_tx::TxSlots::run_ahead`]); the rest are gathered as usual.

use chrono::{DateTime, Utc};

use crate::pg::order_tx::Inbound;

pub struct FastLane {
    /// Age of the call's oldest message from which the lane is open (zero: never).
    backlog: chrono::Duration,
    /// Validity left under which a message is shed.
    margin: chrono::Duration,
}

impl FastLane {
    pub fn new(settings: &crate::config::ConsumerSettings) -> Self {
        metrics::gauge!("order_fast_lane_active").set(0.0);
        Self {
            backlog: chrono::Duration::milliseconds(settings.fast_lane_backlog_ms as i64),
            margin: chrono::Duration::milliseconds(settings.fast_lane_margin_ms as i64),
        }
    }

    /// Which of a call's items go to the fast lane at `now`: none unless the lane is on and
    /// the call's oldest message is at least the threshold old; then the decoded ones with
    /// less than the margin left. Poison never does (it is quarantined in its batch).
    pub fn doomed(&self, items: &[Inbound], now: DateTime<Utc>) -> Vec<bool> {
        let mut doomed = vec![false; items.len()];
        if self.backlog.is_zero() {
            return doomed;
        }
        let events = || items.iter().filter_map(|i| i.event.as_ref().ok());
        let Some(oldest) = events().map(|e| e.reservation_created_at).min() else {
            return doomed;
        };
        let open = now - oldest >= self.backlog;
        metrics::gauge!("order_fast_lane_active").set(if open { 1.0 } else { 0.0 });
        if !open {
            return doomed;
        }
        for (d, item) in doomed.iter_mut().zip(items) {
            if let Ok(e) = &item.event {
                *d = e.reservation_valid_until - now < self.margin;
            }
        }
        doomed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::OrderCreateRequested;

    fn item(now: DateTime<Utc>, age_ms: i64, left_ms: i64) -> Inbound {
        let ids = crate::domain::Ids::generate(1, 0);
        let e = OrderCreateRequested {
            schema_version: 1,
            event_type: "ORDER_CREATE_REQUESTED".into(),
            message_key: ids.reservation_id.clone(),
            message_id: ids.message_id,
            request_id: "req".into(),
            reservation_id: ids.reservation_id,
            order_id: ids.order_id,
            activity_id: 1,
            sku_id: 1,
            user_id: 1,
            quantity: 1,
            reservation_created_at: now - chrono::Duration::milliseconds(age_ms),
            reservation_valid_until: now + chrono::Duration::milliseconds(left_ms),
            created_at: now,
            retry_count: 0,
            replay_count: 0,
            producer: "test".into(),
            trace: Default::default(),
            channel: None,
        };
        Inbound {
            event: Ok(e),
            raw_body: Vec::new(),
            properties: serde_json::Value::Null,
            property_message_id: None,
            broker_msg_id: String::new(),
            delivery_attempt: 0,
        }
    }

    fn lane(backlog_ms: u64, margin_ms: u64) -> FastLane {
        FastLane {
            backlog: chrono::Duration::milliseconds(backlog_ms as i64),
            margin: chrono::Duration::milliseconds(margin_ms as i64),
        }
    }

    #[test]
    fn sheds_only_what_would_expire_and_only_while_behind() {
        let now = Utc::now();
        let open = lane(2_000, 1_500);
        // Behind (the oldest is 2.5 s old): under 1.5 s left or past it is shed.
        let behind = [
            item(now, 2_500, 60_000),
            item(now, 2_400, 1_000),
            item(now, 2_400, -10),
            item(now, 100, 1_499),
            item(now, 100, 1_500),
        ];
        assert_eq!(open.doomed(&behind, now), [false, true, true, true, false]);
        // Not behind: nothing is shed, even what has expired (the batch rejects it in turn).
        let fresh = [item(now, 1_900, 1_000), item(now, 100, -10)];
        assert_eq!(open.doomed(&fresh, now), [false, false]);
        // Off means off.
        assert_eq!(lane(0, 1_500).doomed(&behind, now), [false; 5]);
    }
}
