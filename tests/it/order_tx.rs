//! The order transaction against real PostgreSQL, driving the consumer's handler directly
//! (the one-step function of the consume role): duplicates, poison, expiry, buyers, stock,
//! transient failures. Each test has its own schema.

use std::sync::Arc;

use crate::common::{create_orders, delivery, delivery_of, event, TestEnv};
use seckill::domain::{Decision, RejectReason};
use seckill::mq::{BatchHandler, ConsumeDecision};
use seckill::roles::consume::order_create::OrderCreateHandler;

async fn handler(env: &TestEnv, workers: usize) -> Arc<OrderCreateHandler> {
    Arc::new(OrderCreateHandler::new(
        env.order_pool(workers + 1).await,
        &env.settings,
        workers,
    ))
}

#[tokio::test]
async fn same_message_delivered_100_times_concurrently_makes_one_order() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let e = event(1, 1, 42, 300);
    let d = delivery_of(&topic, &e);
    let calls = (0..100).map(|_| {
        let h = h.clone();
        let d = d.clone();
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(
        decisions.iter().all(|d| *d == ConsumeDecision::Ack),
        "{decisions:?}"
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM event_outbox").await, 2);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    let inv = seckill::invariants::check(
        &**env.pool(1).await.get().await.unwrap(),
        &env.redis().await,
        &env.names().order_create_group,
        1,
        1,
    )
    .await
    .unwrap();
    // Redis was warmed but never reserved (the message was injected), so only PG-side
    // invariants apply: no oversell, one order per buyer, one effect per message, ledger.
    assert!(
        inv.violations.iter().all(|v| v.contains("Redis")),
        "{:?}",
        inv.violations
    );
    env.cleanup().await;
}

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
async fn one_reservation_under_many_message_ids_makes_one_order() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let base = event(1, 1, 11, 300);
    let calls = (0..20).map(|_| {
        let mut e = base.clone();
        e.message_id = seckill::domain::Ids::generate(1, 0).message_id;
        let h = h.clone();
        let d = delivery_of(&topic, &e);
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks").await,
        0
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    env.cleanup().await;
}

#[tokio::test]
async fn one_buyer_with_many_reservations_gets_one_order_and_the_rest_are_compensated() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let calls = (0..10).map(|_| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, 77, 300));
        async move { h.handle(vec![d]).await }
    });
    futures::future::join_all(calls).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE user_id = 77")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'DUPLICATE_BUYER'")
            .await,
        9
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_larger_than_the_stock_left_gets_what_is_left_and_rejects_the_rest() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 3).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let events: Vec<_> = (1..=5).map(|u| event(1, 1, u, 300)).collect();
    let batch: Vec<_> = events.iter().map(|e| delivery_of(&topic, e)).collect();
    let decisions = h.process(&batch).await.unwrap();
    let created = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Created { .. }))
        .count();
    let no_stock = decisions
        .iter()
        .filter(|d| **d == Decision::Rejected(RejectReason::NoStock))
        .count();
    assert_eq!((created, no_stock), (3, 2), "{decisions:?}");
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    assert_eq!(
        env.count("SELECT coalesce(sum(delta),0)::int8 FROM stock_ledger")
            .await,
        -3
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'NO_STOCK'")
            .await,
        2
    );
    // One commit stamp for the transaction, naming its 3 orders, taken after every order
    // row was written (at the end of the transaction, after the stock decrement).
    assert_eq!(
        env.count(
            "SELECT count(*) FROM orders o JOIN order_commits c USING (xact_id)
             WHERE c.orders = 3 AND c.committed_at >= o.created_at"
        )
        .await,
        3
    );
    assert_eq!(env.count("SELECT count(*) FROM order_commits").await, 1);
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_over_several_skus_takes_each_skus_stock_once() {
    let env = TestEnv::without_topics().await;
    env.activity_skus(1, &[(1, 5), (2, 5)]).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let created = |d: &[Decision]| {
        d.iter()
            .filter(|d| matches!(d, Decision::Created { .. }))
            .count()
    };
    let stock = |sku: i64| {
        let env = &env;
        async move {
            env.count(&format!(
                "SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = {sku}"
            ))
            .await
        }
    };
    // Enough of both: every order is created (the optimistic path, one decrement per SKU).
    let first: Vec<_> = [(1, 1), (1, 2), (1, 3), (2, 4), (2, 5)]
        .into_iter()
        .map(|(sku, user)| delivery_of(&topic, &event(1, sku, user, 300)))
        .collect();
    let d = h.process(&first).await.unwrap();
    assert_eq!(created(&d), 5, "{d:?}");
    assert_eq!((stock(1).await, stock(2).await), (2, 3));
    // SKU 1 still has enough, SKU 2 does not: SKU 1 gets all it asked for, SKU 2 what is left.
    let second: Vec<_> = [(1, 6), (1, 7), (2, 8), (2, 9), (2, 10), (2, 11)]
        .into_iter()
        .map(|(sku, user)| delivery_of(&topic, &event(1, sku, user, 300)))
        .collect();
    let d = h.process(&second).await.unwrap();
    let no_stock = d
        .iter()
        .filter(|d| **d == Decision::Rejected(RejectReason::NoStock))
        .count();
    assert_eq!((created(&d), no_stock), (5, 1), "{d:?}");
    assert_eq!((stock(1).await, stock(2).await), (0, 0));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 10);
    assert_eq!(
        env.count("SELECT coalesce(sum(delta),0)::int8 FROM stock_ledger")
            .await,
        -10
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

#[tokio::test]
async fn many_buyers_at_once_never_deadlock_and_never_oversell() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 30).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let calls = (1..=60).map(|user| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, user, 300));
        async move { h.process(&[d]).await }
    });
    let results = futures::future::join_all(calls).await;
    // Concurrent transactions on one hot SKU must serialise on its row, not fail.
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(failures.is_empty(), "transactions failed: {failures:?}");
    let created = results
        .iter()
        .flatten()
        .filter(|d| matches!(d[0], Decision::Created { .. }))
        .count();
    assert_eq!(created, 30);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 30);
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'NO_STOCK'")
            .await,
        30
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    env.cleanup().await;
}

#[tokio::test]
async fn calls_far_past_the_budget_are_gathered_and_never_run_more_transactions_than_the_budget() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 200).await;
    // A pool much larger than the budget: only the limiter can hold the line.
    let h = Arc::new(OrderCreateHandler::new(
        env.pool(20).await,
        &env.settings,
        2,
    ));
    let topic = env.names().order_create_topic;
    // 64 batches at once, as `consume --workers 64` would hand over.
    let calls = (1..=64).map(|user| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, user, 300));
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 64);
    let limiter = h.limiter();
    assert!(
        limiter.high_water() <= 2,
        "transactions at once: {}",
        limiter.high_water()
    );
    assert!(limiter.high_water() >= 1 && limiter.limit() <= 2);
    // The 64 one-message calls were gathered: a few full transactions, not one commit per
    // order (docs/architecture/order-creation.md#gathering-batches-across-queues).
    let transactions = env
        .count("SELECT count(DISTINCT xact_id) FROM orders")
        .await;
    assert!(
        (2..=4).contains(&transactions),
        "64 calls of one message took {transactions} transactions"
    );
    env.cleanup().await;
}

/// Runs 8 calls of 4 messages at once, each call carrying one order of each of 4 stock
/// buckets, through a handler with a budget of 2; returns the transactions that committed
/// orders of more than one bucket, and the transactions in all.
async fn calls_over_four_buckets(env: &TestEnv, activity_id: i64, lanes: bool) -> (i64, i64) {
    env.activity_in_buckets(activity_id, &[(1, 200)], 4).await;
    let mut settings = env.settings.clone();
    settings.consumer.bucket_lanes = lanes;
    let h = Arc::new(OrderCreateHandler::new(env.pool(3).await, &settings, 2));
    let topic = env.names().order_create_topic;
    let calls = (0..8i64).map(|call| {
        let batch = (0..4u16)
            .map(|bucket| {
                let mut e = event(activity_id, 1, call * 4 + i64::from(bucket) + 1, 300);
                let ids = seckill::domain::ids::Ids::generate(activity_id, bucket);
                e.reservation_id = ids.reservation_id.clone();
                e.message_key = ids.reservation_id;
                delivery_of(&topic, &e)
            })
            .collect::<Vec<_>>();
        let h = h.clone();
        async move { h.handle(batch).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    let orders = format!("SELECT count(*) FROM orders WHERE activity_id = {activity_id}");
    assert_eq!(env.count(&orders).await, 32);
    // Each bucket's row gave exactly its 8 orders' units (50 each of 200).
    let rows = format!(
        "SELECT count(*) FROM stock_buckets WHERE activity_id = {activity_id} AND remaining_stock = 42"
    );
    assert_eq!(env.count(&rows).await, 4);
    let mixed = env
        .count(&format!(
            "SELECT count(*) FROM (SELECT xact_id FROM orders WHERE activity_id = {activity_id}
              GROUP BY xact_id HAVING count(DISTINCT stock_bucket) > 1) m"
        ))
        .await;
    let transactions = env
        .count(&format!(
            "SELECT count(DISTINCT xact_id) FROM orders WHERE activity_id = {activity_id}"
        ))
        .await;
    (mixed, transactions)
}

#[tokio::test]
async fn a_call_over_several_stock_buckets_becomes_one_transaction_per_bucket() {
    let env = TestEnv::without_topics().await;
    // Lanes on (the default): no transaction holds two buckets' orders, so no two lock the
    // same stock rows; still gathered (8 calls of 4 took far fewer than 32 transactions).
    let (mixed, transactions) = calls_over_four_buckets(&env, 1, true).await;
    assert_eq!(mixed, 0, "transactions over several buckets");
    assert!(
        (4..=16).contains(&transactions),
        "32 orders of 4 buckets took {transactions} transactions"
    );
    // Off: every call's transaction carries all four buckets' orders.
    let (mixed, transactions) = calls_over_four_buckets(&env, 2, false).await;
    assert_eq!(
        mixed, transactions,
        "with lanes off every transaction mixes buckets"
    );
    env.cleanup().await;
}

/// An order whose home bucket's row has no unit left takes one from another bucket of its SKU
/// (the locked path): the order and its ledger debit name the bucket that gave it, and that
/// row is the one decremented.
#[tokio::test]
async fn an_order_whose_home_bucket_is_empty_takes_its_unit_from_another_bucket() {
    let env = TestEnv::without_topics().await;
    let activity_id = 3;
    env.activity_in_buckets(activity_id, &[(1, 8)], 4).await;
    let pool = env.pool(2).await;
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE stock_buckets SET remaining_stock = 0 WHERE activity_id = $1 AND bucket = 0",
            &[&activity_id],
        )
        .await
        .unwrap();
    let h = OrderCreateHandler::new(pool, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let batch = (1..=3i64)
        .map(|user| {
            let mut e = event(activity_id, 1, user, 300);
            let ids = seckill::domain::ids::Ids::generate(activity_id, 0);
            e.reservation_id = ids.reservation_id.clone();
            e.message_key = ids.reservation_id;
            delivery_of(&topic, &e)
        })
        .collect::<Vec<_>>();
    assert_eq!(h.handle(batch).await, ConsumeDecision::Ack);
    let a = activity_id;
    let q = |sql: String| {
        let env = &env;
        async move { env.count(&sql).await }
    };
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM orders WHERE activity_id = {a} AND stock_bucket <> 0"
        ))
        .await,
        3,
        "every order names the bucket that gave its unit"
    );
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM orders o JOIN stock_ledger l USING (order_id)
             WHERE o.activity_id = {a} AND l.bucket = o.stock_bucket AND l.delta = -1"
        ))
        .await,
        3,
        "each ledger debit is from the order's bucket"
    );
    assert_eq!(
        q(format!(
            "SELECT sum(total_stock - remaining_stock)::int8 FROM stock_buckets
             WHERE activity_id = {a} AND bucket <> 0"
        ))
        .await,
        3
    );
    env.cleanup().await;
}
