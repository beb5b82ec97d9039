//! The batched timeout cancel against real PostgreSQL
//! (docs/architecture/recovery.md#timeout-cancel-and-payment): a delivered batch of
//! CANCEL_ORDER_IF_UNPAID messages is one transaction in which every message keeps the outcome a
//! message alone would get, and a message whose cancel cannot commit is split out without holding
//! back the others.

use crate::common;

use crate::common::{delivery, delivery_of, TestEnv};
use chrono::Utc;
use seckill::domain::events::{cancel_if_unpaid_event_id, reconcile_cancel_if_unpaid_event_id};
use seckill::domain::{CancelOutcome, Decision};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery};
use seckill::pg::order_state::{pay, Payment, StateNames};
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::timeout_cancel::TimeoutCancelHandler;

/// Creates one order per `(sku, user)` through the order consumer; returns their ids.
async fn orders(env: &TestEnv, activity_id: i64, buyers: &[(i64, i64)]) -> Vec<String> {
    let h = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let mut ids = Vec::new();
    for &(sku, user) in buyers {
        let e = common::event(activity_id, sku, user, 300);
        let d = h.process(&[delivery_of(&topic, &e)]).await.unwrap();
        assert!(matches!(d[0], Decision::Created { .. }), "{d:?}");
        ids.push(e.order_id);
    }
    ids
}

/// A cancel message for `order_id` under `event_id`, which says the order expired a second ago.
fn cancel(env: &TestEnv, event_id: String, order_id: &str) -> Delivery {
    let body = serde_json::json!({
        "schema_version": 1, "event_type": "CANCEL_ORDER_IF_UNPAID",
        "event_id": event_id, "order_id": order_id,
        "expires_at": Utc::now() - chrono::Duration::seconds(1),
    });
    let mut d = delivery(
        &env.names().order_timeout_topic,
        Some(&event_id),
        serde_json::to_vec(&body).unwrap(),
    );
    d.keys = order_id.to_string();
    d
}

async fn exec(env: &TestEnv, sql: &str) {
    env.pool(1)
        .await
        .get()
        .await
        .unwrap()
        .batch_execute(sql)
        .await
        .unwrap();
}

/// A batch of cancel messages runs as one transaction, and each message keeps its own outcome. The
/// early one is redelivered and cancels its order once the order has expired.
///
/// One story: the redelivered batch runs against the orders, stock and inbox the first pass left,
/// so both passes share one sale's state in order.
#[tokio::test]
async fn a_batch_of_cancels_is_one_transaction_where_each_message_keeps_its_own_outcome() {
    let env = TestEnv::without_topics().await;
    env.activity_skus(40, &[(1, 10), (2, 10)]).await;
    let o = orders(&env, 40, &[(1, 1), (1, 2), (1, 3), (1, 4), (2, 5), (2, 6)]).await;
    // o[2] is paid in time; then every order but o[3] is past its deadline by the database's
    // clock. o[3]'s message says it expired: only the database's clock decides.
    let n = env.names();
    let names = StateNames {
        order_event_topic: n.order_event_topic.clone(),
        compensate_topic: n.compensate_topic.clone(),
    };
    let pool = env.pool(1).await;
    let paid = pay(
        &mut pool.get().await.unwrap(),
        &Payment {
            order_id: &o[2],
            payment_id: "pay-batch-1",
            amount_cents: 100,
        },
        &names,
    )
    .await
    .unwrap();
    assert!(matches!(paid, seckill::domain::PayOutcome::Paid { .. }));
    exec(
        &env,
        &format!(
            "UPDATE orders SET expires_at = now() - interval '1 second' WHERE order_id <> '{}';
             UPDATE orders SET expires_at = now() + interval '1 hour' WHERE order_id = '{}'",
            o[3], o[3]
        ),
    )
    .await;

    let batch = vec![
        cancel(&env, cancel_if_unpaid_event_id(&o[0]), &o[0]),
        cancel(&env, cancel_if_unpaid_event_id(&o[1]), &o[1]),
        // The same message twice in one batch.
        cancel(&env, cancel_if_unpaid_event_id(&o[0]), &o[0]),
        // Reconcile's re-send for the same order under its own id.
        cancel(&env, reconcile_cancel_if_unpaid_event_id(&o[1]), &o[1]),
        cancel(&env, cancel_if_unpaid_event_id(&o[2]), &o[2]),
        cancel(&env, cancel_if_unpaid_event_id(&o[3]), &o[3]),
        cancel(&env, cancel_if_unpaid_event_id(&o[4]), &o[4]),
        cancel(&env, cancel_if_unpaid_event_id(&o[5]), &o[5]),
        cancel(&env, cancel_if_unpaid_event_id("ord_nobody"), "ord_nobody"),
    ];
    let h = TimeoutCancelHandler::new(env.pool(3).await, &env.settings, 2);
    let out: Vec<Option<CancelOutcome>> = h
        .process(&batch)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(matches!(out[5], Some(CancelOutcome::NotYetExpired { .. })));
    let expected = [
        Some(CancelOutcome::Canceled { version: 2 }),
        Some(CancelOutcome::Canceled { version: 2 }),
        Some(CancelOutcome::Duplicate),
        Some(CancelOutcome::AlreadyCanceled),
        Some(CancelOutcome::AlreadyPaid),
        out[5].clone(),
        Some(CancelOutcome::Canceled { version: 2 }),
        Some(CancelOutcome::Canceled { version: 2 }),
        Some(CancelOutcome::NotFound),
    ];
    assert_eq!(out, expected);

    // Four units back: two per SKU, each with its ledger credit, its compensation task and its
    // two outbox rows; the paid order untouched; the early one still unpaid, its message
    // leaving no inbox row (so that its redelivery is not taken for a duplicate).
    let q = |sql: &'static str| env.count(sql);
    assert_eq!(
        q("SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = 1").await,
        8
    );
    assert_eq!(
        q("SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = 2").await,
        10
    );
    assert_eq!(
        q("SELECT count(*) FROM stock_ledger WHERE reason = 'ORDER_CANCELED'").await,
        4
    );
    assert_eq!(
        q("SELECT count(*) FROM compensation_tasks WHERE reason = 'ORDER_CANCELED'").await,
        4
    );
    assert_eq!(
        q("SELECT count(*) FROM event_outbox WHERE tag IN ('ORDER_CANCELED', 'RELEASE_RESERVATION')")
            .await,
        8
    );
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE status = 'PAID' AND canceled_at IS NULL").await,
        1
    );
    assert_eq!(
        q("SELECT count(*) FROM orders WHERE status = 'CREATED'").await,
        1
    );
    let timeout_inbox = format!(
        "SELECT count(*) FROM consumer_inbox WHERE consumer_group = '{}'",
        n.timeout_group
    );
    let inbox = env.count(&timeout_inbox).await;
    assert_eq!(
        inbox, 7,
        "9 messages, less the in-batch duplicate and the early one"
    );
    assert_eq!(
        h.handle(batch.clone()).await,
        ConsumeDecision::Retry,
        "the early message is redelivered"
    );

    // Once o[3] has expired, the redelivered batch cancels it; everything else is a duplicate.
    exec(
        &env,
        "UPDATE orders SET expires_at = now() - interval '1 second' WHERE status = 'CREATED'",
    )
    .await;
    let again: Vec<Option<CancelOutcome>> = h
        .process(&batch)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let canceled = again
        .iter()
        .filter(|x| matches!(x, Some(CancelOutcome::Canceled { .. })))
        .count();
    let duplicates = again
        .iter()
        .filter(|x| **x == Some(CancelOutcome::Duplicate))
        .count();
    assert_eq!((canceled, duplicates), (1, 8), "{again:?}");
    assert_eq!(
        q("SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = 1").await,
        9
    );
    assert_eq!(h.handle(batch).await, ConsumeDecision::Ack);
    env.cleanup().await;
}

#[tokio::test]
async fn a_cancel_that_cannot_commit_is_split_out_and_the_others_commit() {
    let env = TestEnv::without_topics().await;
    env.activity_skus(41, &[(1, 10), (2, 10)]).await;
    let o = orders(&env, 41, &[(1, 1), (1, 2), (2, 3)]).await;
    exec(
        &env,
        "UPDATE orders SET expires_at = now() - interval '1 second';
         -- SKU 2's unit already counted back (a damaged row): returning it again would pass
         -- the total, so its cancel cannot commit.
         UPDATE stock_buckets SET remaining_stock = total_stock WHERE sku_id = 2",
    )
    .await;
    let batch: Vec<Delivery> = o
        .iter()
        .map(|id| cancel(&env, cancel_if_unpaid_event_id(id), id))
        .collect();
    let h = TimeoutCancelHandler::new(env.pool(3).await, &env.settings, 2);
    let out = h.process(&batch).await;
    assert_eq!(
        out[0].as_ref().unwrap(),
        &Some(CancelOutcome::Canceled { version: 2 })
    );
    assert_eq!(
        out[1].as_ref().unwrap(),
        &Some(CancelOutcome::Canceled { version: 2 })
    );
    let err = out[2].as_ref().unwrap_err();
    assert!(err.to_string().contains("past its total stock"), "{err}");
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = 1")
            .await,
        10
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'CREATED'")
            .await,
        1,
        "the third order's cancel rolled back"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM consumer_inbox WHERE message_id LIKE '%CANCEL_IF_UNPAID'")
            .await,
        2
    );
    assert_eq!(h.handle(batch).await, ConsumeDecision::Retry);
    env.cleanup().await;
}

#[tokio::test]
async fn the_sweep_cancels_orders_whose_timer_is_late_and_the_timer_then_finds_them_cancelled() {
    let env = TestEnv::without_topics().await;
    env.activity_skus(42, &[(1, 10)]).await;
    let o = orders(&env, 42, &[(1, 1), (1, 2), (1, 3), (1, 4)]).await;
    // o[0], o[1]: 10 s past their deadline, no cancel yet (a late timer); o[2]: 1 s past, within
    // the grace (its timer is on its way); o[3]: paid in time, then past its deadline.
    let n = env.names();
    let names = StateNames {
        order_event_topic: n.order_event_topic.clone(),
        compensate_topic: n.compensate_topic.clone(),
    };
    let pool = env.pool(1).await;
    pay(
        &mut pool.get().await.unwrap(),
        &Payment {
            order_id: &o[3],
            payment_id: "pay-sweep-1",
            amount_cents: 100,
        },
        &names,
    )
    .await
    .unwrap();
    exec(
        &env,
        &format!(
            "UPDATE orders SET expires_at = now() - interval '10 seconds';
             UPDATE orders SET expires_at = now() - interval '1 second' WHERE order_id = '{}'",
            o[2]
        ),
    )
    .await;
    let h = TimeoutCancelHandler::new(env.pool(3).await, &env.settings, 2);
    let grace = std::time::Duration::from_secs(3);
    let sweep = h.sweep_once(grace, 32).await.unwrap();
    assert_eq!((sweep.found, sweep.canceled, sweep.full), (2, 2, false));
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        10 - 4 + 2
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM consumer_inbox WHERE message_id LIKE '%.CANCEL_IF_UNPAID.sweep'"
        )
        .await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'CREATED'")
            .await,
        1,
        "the order within its grace is left to its timer"
    );
    // The late timer arrives: a counted no-op.
    let timer = cancel(&env, cancel_if_unpaid_event_id(&o[0]), &o[0]);
    assert_eq!(
        h.process(&[timer]).await.remove(0).unwrap(),
        Some(CancelOutcome::AlreadyCanceled)
    );
    // Nothing else is due; a sweep that takes one at a time says when it may have left some.
    assert_eq!(h.sweep_once(grace, 32).await.unwrap().found, 0);
    exec(
        &env,
        "UPDATE orders SET expires_at = now() - interval '10 seconds' WHERE status = 'CREATED'",
    )
    .await;
    let one = h.sweep_once(grace, 1).await.unwrap();
    assert_eq!((one.found, one.canceled), (1, 1));
    assert_eq!(
        env.count("SELECT count(*) FROM stock_ledger WHERE reason = 'ORDER_CANCELED'")
            .await,
        3
    );
    env.cleanup().await;
}
