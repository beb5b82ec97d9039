//! What the scanner's two watches share (docs/architecture/recovery.md#recovery-paths): the stores,
//! the broker and the settings; a reservation's message rebuilt from its hash; a copy sent
//! with the same message_id; a reservation settled from PostgreSQL. The re-send of
//! unconfirmed reservations (`resend`) and the watch of confirmed ones the consumers never
//! took (`unconsumed`) both build on it, and on nothing of each other's but the watch.

use crate::domain::status::SendStatus;
use std::sync::Arc;

use chrono::Utc;

use crate::config::Settings;
use crate::domain::order_create::ReservationFacts;
use crate::domain::Decision;
use crate::domain::{OrderCreateRequested, TraceContext};
use crate::mq::Names;
use crate::mq::{order_create_message, Publisher, SendOutcome};
use crate::pg::order_tx::{withdraw, Inbound, TxNames};
use crate::redis::reservation::ReservationHash;
use crate::redis::{RedisStore, Release};

/// The stores, the broker and the settings a scanner works with.
pub struct Copies {
    pub(super) redis: RedisStore,
    /// Where an uncertain reservation is settled: the order-create group's inbox.
    pub(super) pool: deadpool_postgres::Pool,
    pub(super) tx_names: TxNames,
    pub(super) publisher: Arc<dyn Publisher>,
    pub(super) settings: Arc<Settings>,
    pub(super) names: Names,
    /// Lease owner id: host, pid and a random part, unique per scanner instance.
    pub(super) owner: String,
}

fn owner_id(kind: &str) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_string());
    format!("{kind}-{host}-{}-{}", std::process::id(), ulid::Ulid::new())
}

/// Rebuilds the original event from the reservation hash (the same ids, a higher retry count)
/// in schema `schema` (`mq.order_event_schema`).
pub fn event_from_reservation(
    f: &std::collections::HashMap<String, String>,
    schema: i32,
) -> Option<OrderCreateRequested> {
    let r = ReservationHash::parse(f)?;
    let (trace_id, span_id) =
        crate::domain::ids::parse_traceparent(&r.traceparent).unwrap_or_default();
    let facts = ReservationFacts {
        reservation: r.reservation(),
        quantity: 1,
        created_at: r.created_at,
        valid_until: r.valid_until,
        channel: r.channel.as_deref(),
    };
    let trace = TraceContext {
        trace_id,
        span_id,
        traceparent: r.traceparent.clone(),
    };
    let retry_count = (r.send_attempt - 1).max(0) as i32;
    Some(OrderCreateRequested::new(
        &facts,
        schema,
        "seckill-scan",
        retry_count,
        trace,
    ))
}

impl Copies {
    pub(super) fn new(
        redis: RedisStore,
        pool: deadpool_postgres::Pool,
        publisher: Arc<dyn Publisher>,
        settings: Arc<Settings>,
    ) -> Self {
        Self {
            names: settings.names().clone(),
            tx_names: TxNames::order_create(&settings),
            redis,
            pool,
            publisher,
            settings,
            owner: owner_id("scanner"),
        }
    }

    /// Settles a reservation whose re-send was refused after its validity and grace. The
    /// consumer's own transaction withdraws the message (`pg::order_tx::withdraw`): rejected,
    /// with its compensation, and its inbox row fences any copy still in the broker (a later
    /// delivery is a duplicate). If a copy reached the consumer first, the inbox says so and
    /// that decision stands (its order, or its rejection's compensation). Returns the verdict:
    /// `fenced` (the unit released here, once, through the compensation script) or `consumed`.
    pub(super) async fn settle(
        &self,
        activity_id: i64,
        rid: &str,
        event: &OrderCreateRequested,
        now_ms: i64,
    ) -> anyhow::Result<&'static str> {
        let item = Inbound {
            event: Ok(event.clone()),
            raw_body: event.encode(),
            properties: serde_json::json!({ "message_id": event.message_id, "settled_by": self.owner }),
            property_message_id: Some(event.message_id.clone()),
            broker_msg_id: String::new(),
            delivery_attempt: 0,
        };
        let mut client = self.pool.get().await?;
        let decisions = withdraw(
            &mut client,
            &self.tx_names,
            std::slice::from_ref(&item),
            Utc::now(),
        )
        .await?;
        let (verdict, mq_status) = match decisions.first() {
            Some(Decision::Rejected(_)) => ("fenced", SendStatus::MqFenced.as_str()),
            _ => ("consumed", SendStatus::MqSent.as_str()),
        };
        if verdict == "fenced" {
            self.redis
                .sends()
                .release_many(
                    &[Release {
                        activity_id,
                        sku_id: event.sku_id,
                        reservation_id: rid,
                        reason: "SEND_FENCED",
                    }],
                    now_ms,
                )
                .await?;
        }
        self.redis
            .sends()
            .settle(activity_id, rid, &event.message_id, mq_status, now_ms)
            .await?;
        metrics::counter!("reservation_settled_total", "verdict" => verdict).increment(1);
        Ok(verdict)
    }

    /// Sends a copy of a reservation's message (the same message_id) and counts it as a send
    /// to the order-create topic.
    pub(super) async fn send_copy(&self, event: &OrderCreateRequested) -> SendOutcome {
        let msg = order_create_message(&self.names.order_create_topic, event);
        let outcome = self
            .publisher
            .send(msg, self.settings.mq.send_timeout_ms)
            .await;
        metrics::counter!("mq_publish_total", "topic" => "order_create", "outcome" => outcome.label())
            .increment(1);
        if let SendOutcome::Unknown { .. } = outcome {
            metrics::counter!("mq_publish_unknown_total", "topic" => "order_create").increment(1);
        }
        outcome
    }
}
