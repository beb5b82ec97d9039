//! Reservations, order-create messages and orders made without the API, and the events a
//! consumer group of the test's own collects.

use std::sync::Arc;

use chrono::Utc;
use seckill::domain::{Ids, OrderCreateRequested, TraceContext};
use seckill::mq::Delivery;
use seckill::redis::RedisStore;

use super::*;

/// A valid ORDER_CREATE_REQUESTED for a buyer, valid for `valid_secs` (negative: already expired).
pub fn event(activity_id: i64, sku_id: i64, user_id: i64, valid_secs: i64) -> OrderCreateRequested {
    let ids = Ids::generate(activity_id, 0);
    let now = Utc::now();
    let created = if valid_secs > 0 {
        now
    } else {
        now + chrono::Duration::seconds(valid_secs - 60)
    };
    OrderCreateRequested {
        schema_version: 1,
        event_type: "ORDER_CREATE_REQUESTED".into(),
        message_key: ids.reservation_id.clone(),
        message_id: ids.message_id,
        request_id: format!("req-{user_id}"),
        reservation_id: ids.reservation_id,
        order_id: ids.order_id,
        activity_id,
        sku_id,
        user_id,
        quantity: 1,
        reservation_created_at: created,
        reservation_valid_until: now + chrono::Duration::seconds(valid_secs),
        created_at: now,
        retry_count: 0,
        replay_count: 0,
        producer: "test".into(),
        trace: TraceContext::default(),
        channel: None,
    }
}

/// The delivery a broker would hand the consumer for `body`.
pub fn delivery(topic: &str, message_id: Option<&str>, body: Vec<u8>) -> Delivery {
    let mut properties = seckill::mq::Properties::default();
    if let Some(id) = message_id {
        properties.insert("message_id".to_string(), id.to_string());
    }
    Delivery {
        topic: topic.to_string(),
        properties,
        body,
        broker_msg_id: format!("test-{}", ulid::Ulid::new()),
        ..Default::default()
    }
}

pub fn delivery_of(topic: &str, e: &OrderCreateRequested) -> Delivery {
    delivery(topic, Some(&e.message_id), e.encode())
}

/// `events` as one transaction of the order handler, every one of which must become an order.
pub async fn create_orders(
    h: &seckill::roles::consume::order_create::OrderCreateHandler,
    topic: &str,
    events: &[OrderCreateRequested],
) {
    let deliveries: Vec<_> = events.iter().map(|e| delivery_of(topic, e)).collect();
    let decisions = h.process(&deliveries).await.unwrap();
    assert!(
        decisions
            .iter()
            .all(|d| matches!(d, seckill::domain::Decision::Created { .. })),
        "{decisions:?}"
    );
}

/// One reservation attempt in Redis exactly as the API makes it (the buyer's home bucket, ids
/// minted first), without sending; the first re-send is due in `next_retry_in_ms`.
pub async fn try_reserve(
    redis: &RedisStore,
    activity_id: i64,
    user_id: i64,
    request_id: &str,
    next_retry_in_ms: i64,
) -> (Ids, seckill::redis::ReserveResult) {
    let bucket = redis.home_shard(activity_id, user_id).await.unwrap().bucket;
    let ids = Ids::generate(activity_id, bucket);
    let now = Utc::now().timestamp_millis();
    let r = redis
        .intake()
        .reserve(&seckill::redis::ReserveArgs {
            reservation: seckill::domain::order_create::ReservationRef {
                message_id: &ids.message_id,
                request_id,
                reservation_id: &ids.reservation_id,
                order_id: &ids.order_id,
                activity_id,
                sku_id: 1,
                user_id,
            },
            now_ms: now,
            next_retry_at_ms: now + next_retry_in_ms,
            traceparent: "",
            valid_secs: 300,
            limits: Default::default(),
            channel: "",
            pass_id: "",
        })
        .await
        .unwrap();
    (ids, r)
}

/// Reserves in Redis exactly as the API does, without sending (as if the process died
/// right after the script); the first re-send is due in `next_retry_in_ms`.
pub async fn reserve_only(
    redis: &RedisStore,
    activity_id: i64,
    user_id: i64,
    next_retry_in_ms: i64,
) -> Ids {
    let request_id = format!("req-{user_id}");
    let (ids, r) = try_reserve(redis, activity_id, user_id, &request_id, next_retry_in_ms).await;
    assert!(
        matches!(r, seckill::redis::ReserveResult::Reserved(_)),
        "{r:?}"
    );
    ids
}

/// Orders of `activity_id` SKU 1 for `users`, reserved in Redis exactly as the API does, then
/// created by the order consumer's handler (no broker involved).
pub async fn created_orders(env: &TestEnv, activity_id: i64, users: &[i64]) -> Vec<Ids> {
    let redis = env.redis().await;
    let names = env.settings.names();
    let handler = seckill::roles::consume::order_create::OrderCreateHandler::new(
        env.pool(2).await,
        &env.settings,
        1,
    );
    let mut out = Vec::new();
    for &user in users {
        let ids = reserve_only(&redis, activity_id, user, 600_000).await;
        let now = Utc::now().timestamp_millis();
        let fields = redis
            .reservation(activity_id, &ids.reservation_id)
            .await
            .unwrap();
        let event = seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
        handler
            .process(&[delivery_of(&names.order_create_topic, &event)])
            .await
            .unwrap();
        redis
            .sends()
            .mark_sent(activity_id, &ids.reservation_id, &ids.message_id, "b", now)
            .await
            .unwrap();
        out.push(ids);
    }
    out
}

/// Every message of the order-event topic, as a consumer gets it.
#[derive(Default)]
pub struct Collector(std::sync::Mutex<Vec<Delivery>>);

#[async_trait::async_trait]
impl seckill::mq::BatchHandler for Collector {
    async fn handle(&self, batch: Vec<Delivery>) -> seckill::mq::ConsumeDecision {
        self.0.lock().unwrap().extend(batch);
        seckill::mq::ConsumeDecision::Ack
    }
}

impl Collector {
    /// The ORDER_PAID copies of `order_id` delivered so far.
    pub fn paid(&self, order_id: &str) -> Vec<Delivery> {
        self.tagged("ORDER_PAID", order_id)
    }

    /// The copies of `order_id`'s events tagged `tag` delivered so far.
    pub fn tagged(&self, tag: &str, order_id: &str) -> Vec<Delivery> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.tags == tag && d.keys == order_id)
            .cloned()
            .collect()
    }
}

/// A consumer group of its own on the order-event topic.
pub async fn collect_events(
    env: &TestEnv,
) -> (
    Arc<Collector>,
    seckill::mq::rocketmq::ConsumerHandle,
    String,
) {
    let group = format!("CG_{}_EVENT_COLLECTOR", env.settings.env);
    let spec = seckill::roles::ops::topics::tool_group(&env.settings, &group);
    seckill::mq::create_groups(&env.settings, &[spec])
        .await
        .expect("the collector's group");
    let collector = Arc::new(Collector::default());
    let handle = seckill::mq::start_consumer(
        &env.settings,
        &group,
        &env.settings.names().order_event_topic,
        collector.clone(),
        2,
        16,
    )
    .await
    .unwrap();
    (collector, handle, group)
}
