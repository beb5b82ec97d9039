//! What one message comes to in the order transaction
//! (docs/architecture/order-creation.md#the-order-transaction): an order's row, ledger debit,
//! outbox events and inbox row written together, its events the event structs' own documents;
//! poison quarantined with its raw body; an expired reservation rejected with one compensation;
//! a transient failure rolled back whole and redelivered.

use super::handler;
use crate::common::{create_orders, delivery, delivery_of, event, TestEnv};
use seckill::domain::{Decision, RejectReason};
use seckill::mq::{BatchHandler, ConsumeDecision};

#[tokio::test]
async fn order_row_ledger_outbox_and_inbox_are_written_together() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 1).await;
    let n = env.names();
    let e = event(1, 1, 7, 300);
    let decisions = h
        .process(&[delivery_of(&n.order_create_topic, &e)])
        .await
        .unwrap();
    assert_eq!(
        decisions,
        vec![Decision::Created {
            order_id: e.order_id.clone()
        }]
    );
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let row = c
        .query_one("SELECT status, reservation_id, user_id, expires_at > now() FROM orders WHERE order_id = $1", &[&e.order_id])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "CREATED");
    assert_eq!(row.get::<_, String>(1), e.reservation_id);
    assert_eq!(row.get::<_, i64>(2), 7);
    assert!(row.get::<_, bool>(3));
    let ledger = c
        .query_one(
            "SELECT delta, reason FROM stock_ledger WHERE order_id = $1",
            &[&e.order_id],
        )
        .await
        .unwrap();
    assert_eq!(
        (ledger.get::<_, i32>(0), ledger.get::<_, String>(1)),
        (-1, "ORDER_CREATED".to_string())
    );
    let outbox = c
        .query("SELECT topic, tag, deliver_at IS NOT NULL, status FROM event_outbox WHERE aggregate_id = $1 ORDER BY tag", &[&e.order_id])
        .await
        .unwrap();
    let outbox: Vec<(String, String, bool, String)> = outbox
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        outbox,
        vec![
            (
                n.order_timeout_topic.clone(),
                "CANCEL_IF_UNPAID".to_string(),
                true,
                "PENDING".to_string()
            ),
            (
                n.order_event_topic.clone(),
                "ORDER_CREATED".to_string(),
                false,
                "PENDING".to_string()
            ),
        ]
    );
    let inbox = c
        .query_one(
            "SELECT status, decision FROM consumer_inbox WHERE consumer_group = $1 AND message_id = $2",
            &[&n.order_create_group, &e.message_id],
        )
        .await
        .unwrap();
    assert_eq!(
        (inbox.get::<_, String>(0), inbox.get::<_, String>(1)),
        ("SUCCEEDED".into(), "CREATED".into())
    );
    drop(c);
    env.cleanup().await;
}

/// A created order's two events are written by one statement in which PostgreSQL builds the
/// documents (src/pg/order_tx/docs.rs): each must be the event struct's own document as serde
/// writes it, field for field and value for value (timestamps in serde's form included), so
/// the event contract has one definition.
///
/// One story: both documents come from the one statement that created the three orders, and each is
/// compared with the struct built from that same order.
#[tokio::test]
async fn created_orders_events_are_the_event_structs_own_documents() {
    use chrono::{DateTime, Utc};
    use seckill::domain::events::{
        cancel_if_unpaid_event_id, order_created_event_id, CancelOrderIfUnpaid, OrderCreated,
        OrderRef,
    };

    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 1).await;
    let n = env.names();
    let events: Vec<_> = (1..=3)
        .map(|user| {
            let mut e = event(1, 1, user, 300);
            e.trace.traceparent =
                format!("00-0af7651916cd43dd8448eb211c8031{user:02x}-b7ad6b7169203331-01");
            e
        })
        .collect();
    create_orders(&h, &n.order_create_topic, &events).await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let instant = |v: &serde_json::Value, field: &str| -> DateTime<Utc> {
        let text = v[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field} in {v}"));
        text.parse()
            .unwrap_or_else(|e| panic!("{field} {text}: {e}"))
    };
    for e in &events {
        let rows = c
            .query(
                "SELECT x.tag, x.event_id, x.message_key, x.aggregate_version, x.payload,
                        x.deliver_at, x.next_attempt_at, o.expires_at
                   FROM event_outbox x JOIN orders o ON o.order_id = x.aggregate_id
                  WHERE x.aggregate_id = $1 ORDER BY x.tag",
                &[&e.order_id],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), 2, "two events for {}", e.order_id);
        let (cancel, created) = (&rows[0], &rows[1]);
        let order_expires_at: DateTime<Utc> = created.get(7);

        // ORDER_CREATED: version 1 of the order, relayed at once.
        assert_eq!(created.get::<_, String>(0), "ORDER_CREATED");
        assert_eq!(
            created.get::<_, String>(1),
            order_created_event_id(&e.order_id)
        );
        assert_eq!(created.get::<_, String>(2), e.order_id);
        assert_eq!(created.get::<_, Option<i32>>(3), Some(1));
        assert_eq!(created.get::<_, Option<DateTime<Utc>>>(5), None);
        let stored: serde_json::Value = created.get(4);
        let (occurred_at, expires_at) = (
            instant(&stored, "occurred_at"),
            instant(&stored, "expires_at"),
        );
        let facts = OrderRef {
            order_id: e.order_id.clone(),
            reservation_id: e.reservation_id.clone(),
            activity_id: e.activity_id,
            sku_id: e.sku_id,
            user_id: e.user_id,
        };
        let mut own = OrderCreated::new(&facts, expires_at);
        own.base.occurred_at = Some(occurred_at);
        own.traceparent = Some(e.trace.traceparent.clone());
        assert_eq!(stored, serde_json::to_value(&own).unwrap());
        // The document's deadline is the order's (PostgreSQL keeps microseconds).
        assert!(
            (expires_at - order_expires_at)
                .num_microseconds()
                .unwrap()
                .abs()
                < 1,
            "{expires_at} against the order's {order_expires_at}"
        );
        assert_eq!(
            (expires_at - occurred_at).num_seconds(),
            env.settings.consumer.pay_window_secs as i64
        );

        // CANCEL_ORDER_IF_UNPAID: unversioned, delivered at the deadline, first sent
        // `scan.timer_lead_secs` before it.
        assert_eq!(cancel.get::<_, String>(0), "CANCEL_IF_UNPAID");
        let cancel_id = cancel_if_unpaid_event_id(&e.order_id);
        assert_eq!(cancel.get::<_, String>(1), cancel_id);
        assert_eq!(cancel.get::<_, String>(2), e.order_id);
        assert_eq!(cancel.get::<_, Option<i32>>(3), None);
        let deliver_at: DateTime<Utc> = cancel.get(5);
        let first_send_at: DateTime<Utc> = cancel.get(6);
        assert_eq!(deliver_at, order_expires_at);
        assert_eq!(
            (deliver_at - first_send_at).num_seconds(),
            env.settings.scan.timer_lead_secs as i64
        );
        let stored: serde_json::Value = cancel.get(4);
        let mut own =
            CancelOrderIfUnpaid::new(cancel_id, &e.order_id, e.activity_id, e.sku_id, expires_at);
        own.traceparent = Some(e.trace.traceparent.clone());
        assert_eq!(stored, serde_json::to_value(&own).unwrap());
    }
    drop(c);
    env.cleanup().await;
}

#[tokio::test]
async fn poison_bodies_are_quarantined_with_their_raw_body_and_acknowledged() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let mut unsupported = serde_json::to_value(event(1, 1, 1, 300)).unwrap();
    unsupported["schema_version"] = 9.into();
    let mut missing = serde_json::to_value(event(1, 1, 2, 300)).unwrap();
    missing.as_object_mut().unwrap().remove("user_id");
    let good = event(1, 1, 3, 300);
    let batch = vec![
        delivery(&topic, Some("evt_garbage"), b"\x00\xffnot json".to_vec()),
        delivery(&topic, None, serde_json::to_vec(&unsupported).unwrap()),
        delivery(&topic, None, serde_json::to_vec(&missing).unwrap()),
        delivery_of(&topic, &good),
    ];
    let decisions = h.process(&batch).await.unwrap();
    assert_eq!(
        decisions,
        vec![
            Decision::Quarantined("INVALID_JSON"),
            Decision::Quarantined("UNSUPPORTED_SCHEMA"),
            Decision::Quarantined("INVALID_EVENT"),
            Decision::Created {
                order_id: good.order_id.clone()
            },
        ],
        "poison never fails the good message beside it"
    );
    assert_eq!(h.handle(vec![batch[0].clone()]).await, ConsumeDecision::Ack);
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let raw: Vec<u8> = c
        .query_one(
            "SELECT raw_body FROM quarantined_messages WHERE message_id = 'evt_garbage' LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(raw, b"\x00\xffnot json".to_vec());
    assert_eq!(
        env.count("SELECT count(*) FROM quarantined_messages").await,
        4
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    drop(c);
    env.cleanup().await;
}

#[tokio::test]
async fn expired_reservation_is_rejected_with_exactly_one_compensation() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let e = event(1, 1, 5, -1);
    let d = delivery_of(&topic, &e);
    assert_eq!(
        h.process(std::slice::from_ref(&d)).await.unwrap(),
        vec![Decision::Rejected(RejectReason::Expired)]
    );
    // Redelivery and a second message for the same reservation change nothing.
    assert_eq!(
        h.process(&[d]).await.unwrap(),
        vec![Decision::DuplicateMessage]
    );
    let mut again = e.clone();
    again.message_id = seckill::domain::Ids::generate(1, 0).message_id;
    assert_eq!(
        h.process(&[delivery_of(&topic, &again)]).await.unwrap(),
        vec![Decision::DuplicateReservation]
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'RELEASE_RESERVATION'")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM reservations WHERE status = 'REJECTED' AND reject_reason = 'EXPIRED'").await,
        1
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        10
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_transient_failure_rolls_everything_back_and_asks_for_redelivery() {
    let mut env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    // A short statement timeout, and another session holding the hot stock row: the order
    // transaction hits 57014 (query_canceled), a transient error.
    env.settings.pg.statement_timeout_ms = 300;
    let h = handler(&env, 1).await;
    let locker_pool = env.pool(1).await;
    let mut locker = locker_pool.get().await.unwrap();
    let lock_tx = locker.transaction().await.unwrap();
    lock_tx
        .execute(
            "SELECT 1 FROM stock_buckets WHERE activity_id = 1 AND sku_id = 1 FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    let topic = env.names().order_create_topic;
    let e = event(1, 1, 9, 300);
    let d = delivery_of(&topic, &e);
    let err = h.process(std::slice::from_ref(&d)).await.unwrap_err();
    assert_eq!(err.class(), "transient", "{err}");
    assert_eq!(h.handle(vec![d.clone()]).await, ConsumeDecision::Retry);
    // Nothing of the message survived the rollback: not even its inbox row.
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 0);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);
    lock_tx.rollback().await.unwrap();
    // The redelivery succeeds once the lock is gone.
    assert_eq!(h.handle(vec![d]).await, ConsumeDecision::Ack);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    drop(locker);
    env.cleanup().await;
}
