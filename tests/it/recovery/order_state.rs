//! An order after its creation: the timeout cancel and the payment
//! (docs/architecture/recovery.md#timeout-cancel-and-payment) — an early cancel changes nothing,
//! a paid order is never cancelled and a cancelled one's payment is owed back — and the
//! projection of its status into Redis (docs/architecture/recovery.md#projection), applied by
//! version and held while order creation is behind.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use crate::common::{delivery, delivery_of, eventually, TestEnv};
use chrono::Utc;
use seckill::domain::{CancelOutcome, PayOutcome};
use seckill::domain::{Decision, Ids};
use seckill::mq::BatchHandler;
use seckill::pg::order_state::{pay, Payment, StateNames};
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::timeout_cancel::TimeoutCancelHandler;

/// A payment of a test order (every test SKU costs 100 cents).
fn payment<'a>(order_id: &'a str, payment_id: &'a str) -> Payment<'a> {
    Payment {
        order_id,
        payment_id,
        amount_cents: 100,
    }
}

fn state_names(env: &TestEnv) -> StateNames {
    let n = env.names();
    StateNames {
        order_event_topic: n.order_event_topic,
        compensate_topic: n.compensate_topic,
    }
}

async fn created_orders(env: &TestEnv, activity_id: i64, n: i64) -> Vec<String> {
    let h = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let mut ids = Vec::new();
    for user in 1..=n {
        let e = common::event(activity_id, 1, user, 300);
        let d = h.process(&[delivery_of(&topic, &e)]).await.unwrap();
        assert!(matches!(d[0], Decision::Created { .. }));
        ids.push(e.order_id);
    }
    ids
}

fn cancel_delivery(
    env: &TestEnv,
    order_id: &str,
    expires_at: chrono::DateTime<Utc>,
) -> seckill::mq::Delivery {
    let body = serde_json::json!({
        "schema_version": 1, "event_type": "CANCEL_ORDER_IF_UNPAID",
        "event_id": seckill::domain::events::cancel_if_unpaid_event_id(order_id),
        "order_id": order_id, "expires_at": expires_at,
    });
    delivery(
        &env.names().order_timeout_topic,
        None,
        serde_json::to_vec(&body).unwrap(),
    )
}

/// What one cancel message comes to, through the batched handler.
async fn cancel_one(h: &TimeoutCancelHandler, d: &seckill::mq::Delivery) -> Option<CancelOutcome> {
    h.process(std::slice::from_ref(d)).await.remove(0).unwrap()
}

/// A cancel that comes before the order's deadline changes nothing and is redelivered. After the
/// deadline it cancels once, and a payment that comes later is owed back.
///
/// One story: the same cancel message is processed before and after the deadline, and the late
/// payment meets the order that cancel left.
#[tokio::test]
async fn an_early_cancel_changes_nothing_and_cancels_after_expiry() {
    let env = TestEnv::without_topics().await;
    env.activity(30, 1, 5).await;
    let order_id = created_orders(&env, 30, 1).await.remove(0);
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    c.execute(
        "UPDATE orders SET expires_at = now() + interval '1500 milliseconds'",
        &[],
    )
    .await
    .unwrap();
    let expires_at: chrono::DateTime<Utc> = c
        .query_one("SELECT expires_at FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    let h = TimeoutCancelHandler::new(env.pool(3).await, &env.settings, 2);
    let d = cancel_delivery(&env, &order_id, expires_at);
    assert!(matches!(
        cancel_one(&h, &d).await,
        Some(CancelOutcome::NotYetExpired { .. })
    ));
    assert_eq!(
        h.handle(vec![d.clone()]).await,
        seckill::mq::ConsumeDecision::Retry,
        "redelivered later"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'CREATED'")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM consumer_inbox WHERE consumer_group LIKE '%TIMEOUT%'")
            .await,
        0
    );

    while Utc::now() <= expires_at {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(matches!(
        cancel_one(&h, &d).await,
        Some(CancelOutcome::Canceled { version: 2 })
    ));
    assert_eq!(cancel_one(&h, &d).await, Some(CancelOutcome::Duplicate));
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        5,
        "unit returned"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM stock_ledger WHERE reason = 'ORDER_CANCELED'")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'ORDER_CANCELED'")
            .await,
        1
    );
    assert_eq!(env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_CANCELED' AND aggregate_version = 2").await, 1);
    let mut client = pool.get().await.unwrap();
    assert_eq!(
        pay(
            &mut client,
            &payment(&order_id, "pay-1"),
            &state_names(&env)
        )
        .await
        .unwrap(),
        PayOutcome::Canceled
    );
    // The buyer paid for a cancelled order: owed back, once, with its event.
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations WHERE payment_id = 'pay-1' AND reason = 'ORDER_CANCELED' AND status = 'PENDING'").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'REFUND_REQUIRED' AND aggregate_version = 2").await,
        1
    );
    drop(c);
    env.cleanup().await;
}

/// A hundred payments race cancel batches for the same orders: each order ends paid or cancelled,
/// never both. Each cancel gives its unit back once, and each payment that lost is owed back once.
///
/// One story: the end counts read what the race left, so the payments, the cancel batches and the
/// checks share one set of orders in order.
#[tokio::test]
async fn pay_and_cancel_raced_100_times_each_never_both_win() {
    let env = TestEnv::without_topics().await;
    env.activity(40, 1, 100).await;
    let orders = created_orders(&env, 40, 100).await;
    // 100 payers share 12 connections while the cancel batches hold their orders' rows: on a
    // loaded machine a payer can wait for a connection longer than the shipped 1 s, which would
    // fail the race for a reason that is not the race.
    let mut pg = env.settings.pg.clone();
    pg.pool_wait_timeout_ms = 30_000;
    let pool = seckill::pg::connect_pool(&pg, 12).await.expect("pg pool");
    {
        let c = pool.get().await.unwrap();
        c.execute(
            "UPDATE orders SET expires_at = now() + interval '400 milliseconds'",
            &[],
        )
        .await
        .unwrap();
    }
    let expires_at: chrono::DateTime<Utc> = pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT min(expires_at) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    let cancel = Arc::new(TimeoutCancelHandler::new(
        env.pool(6).await,
        &env.settings,
        5,
    ));
    let names = state_names(&env);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, id) in orders.iter().enumerate() {
        let (pool, names, order_id) = (pool.clone(), names.clone(), id.clone());
        let jitter = Duration::from_millis(((i * 37) % 200) as u64 + 300);
        tasks.spawn(async move {
            tokio::time::sleep(jitter).await;
            let mut c = pool.get().await.unwrap();
            let payment_id = format!("pay-{order_id}");
            pay(&mut c, &payment(&order_id, &payment_id), &names)
                .await
                .unwrap();
        });
    }
    // The cancels come as the broker hands them over: in batches (of 10 here), each batch one
    // transaction racing the payments of its orders.
    for (b, chunk) in orders.chunks(10).enumerate() {
        let cancel = cancel.clone();
        let batch: Vec<_> = chunk
            .iter()
            .map(|id| cancel_delivery(&env, id, expires_at))
            .collect();
        let jitter = Duration::from_millis(((b * 53) % 200) as u64 + 300);
        tasks.spawn(async move {
            tokio::time::sleep(jitter).await;
            // An early delivery is redelivered: retry until every message is decided.
            while cancel
                .process(&batch)
                .await
                .into_iter()
                .any(|o| matches!(o.unwrap(), Some(CancelOutcome::NotYetExpired { .. })))
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let paid = env
        .count("SELECT count(*) FROM orders WHERE status = 'PAID'")
        .await;
    let canceled = env
        .count("SELECT count(*) FROM orders WHERE status = 'CANCELED'")
        .await;
    assert_eq!(paid + canceled, 100);
    assert!(
        paid > 0 && canceled > 0,
        "the race should go both ways: {paid} paid, {canceled} canceled"
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM orders WHERE paid_at IS NOT NULL AND canceled_at IS NOT NULL"
        )
        .await,
        0
    );
    assert_eq!(
        env.count("SELECT count(*) FROM stock_ledger WHERE reason = 'ORDER_CANCELED'")
            .await,
        canceled,
        "each cancel released once"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks").await,
        canceled
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        canceled
    );
    assert_eq!(
        env.count("SELECT count(*) FROM stock_ledger l JOIN orders o USING (order_id) WHERE o.status = 'PAID' AND l.reason = 'ORDER_CANCELED'").await,
        0,
        "a paid order is never cancelled"
    );
    // Every order got a payment: each one that lost the race (after the cancel, or after the
    // deadline before it) is owed back, exactly once; no payment that won is.
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations r JOIN orders o USING (order_id) WHERE o.status = 'CANCELED' AND r.reason IN ('ORDER_CANCELED', 'ORDER_EXPIRED')").await,
        canceled
    );
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations").await,
        canceled
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'REFUND_REQUIRED'")
            .await,
        canceled
    );
    env.cleanup().await;
}

#[tokio::test]
async fn order_events_are_projected_by_version_so_stale_and_repeated_events_are_no_ops() {
    let env = TestEnv::without_topics().await;
    let names = env.names();
    let h = seckill::roles::consume::projection::ProjectionHandler {
        redis: env.redis().await,
        pool: env.pool(1).await,
        group: names.projection_group.clone(),
        deferral: None,
    };
    let ids = Ids::generate(1, 0);
    let ev = |version: i32, status: &str| {
        let body = serde_json::json!({
            "event_type": format!("ORDER_{status}"), "order_id": ids.order_id,
            "reservation_id": ids.reservation_id, "status": status, "aggregate_version": version,
            "user_id": 5,
        });
        delivery(
            &names.order_event_topic,
            None,
            serde_json::to_vec(&body).unwrap(),
        )
    };
    // One batch, one round trip: PAID (v2) ahead of CREATED (v1) is applied after it, in the
    // order's sequence; v2 arrives twice; a poison body among them is quarantined without
    // failing the others.
    let poison = delivery(&names.order_event_topic, None, b"nope".to_vec());
    let batch = [ev(2, "PAID"), ev(1, "CREATED"), ev(2, "PAID"), poison];
    assert_eq!(
        h.process(&batch).await.unwrap(),
        ["applied", "applied", "stale", "quarantined"]
    );
    let redis = env.redis().await;
    let p = redis
        .projections()
        .projection(&ids.reservation_id)
        .await
        .unwrap();
    assert_eq!((p["status"].as_str(), p["version"].as_str()), ("PAID", "2"));
    // The buyer is kept, so that only they read the projection.
    assert_eq!(p["user_id"], "5");
    assert_eq!(
        env.count("SELECT count(*) FROM quarantined_messages").await,
        1
    );
    // A Redis that lost its script cache (a restart) answers the pipeline NOSCRIPT: the script
    // is loaded again and the batch applied.
    let mut conn = redis.pool.get().await.unwrap();
    let _: () = deadpool_redis::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(h.process(&[ev(3, "CANCELED")]).await.unwrap(), ["applied"]);
    let p = redis
        .projections()
        .projection(&ids.reservation_id)
        .await
        .unwrap();
    assert_eq!(p["status"], "CANCELED");
    env.cleanup().await;
}

#[tokio::test]
async fn while_orders_are_behind_the_projection_holds_its_batches_and_applies_them_after() {
    use seckill::mq::BatchHandler as _;
    use seckill::roles::consume::deferral::Deferral;
    let env = TestEnv::without_topics().await;
    let names = env.names();
    let deferral = Arc::new(Deferral::new(Duration::from_secs(10)));
    let h = Arc::new(seckill::roles::consume::projection::ProjectionHandler {
        redis: env.redis().await,
        pool: env.pool(1).await,
        group: names.projection_group.clone(),
        deferral: Some(deferral.clone()),
    });
    let ids = Ids::generate(1, 0);
    let body = serde_json::json!({
        "event_type": "ORDER_CREATED", "order_id": ids.order_id,
        "reservation_id": ids.reservation_id, "status": "CREATED", "aggregate_version": 1,
        "user_id": 5,
    });
    let event = delivery(
        &names.order_event_topic,
        None,
        serde_json::to_vec(&body).unwrap(),
    );
    // The order backlog's oldest message is 20 s old: the batch is held, not applied.
    assert!(deferral.note_backlog(Duration::from_secs(20)));
    let handled = tokio::spawn({
        let h = h.clone();
        async move { h.handle(vec![event]).await }
    });
    eventually(10, "the batch is held", || async {
        deferral.holding() == 1
    })
    .await;
    let redis = env.redis().await;
    assert!(
        redis
            .projections()
            .projection(&ids.reservation_id)
            .await
            .unwrap()
            .is_empty(),
        "nothing projected while held"
    );
    // Orders caught up (under half the threshold): the batch is applied and ACKed.
    assert!(!deferral.note_backlog(Duration::from_secs(4)));
    assert_eq!(handled.await.unwrap(), seckill::mq::ConsumeDecision::Ack);
    let p = redis
        .projections()
        .projection(&ids.reservation_id)
        .await
        .unwrap();
    assert_eq!(p["status"], "CREATED");
    assert_eq!(deferral.holding(), 0);
    env.cleanup().await;
}

/// ORDER_PAID delivered before its ORDER_CREATED, in separate batches (transaction mode, where a
/// half message is not keyed to the order's queue): the broker is asked to hold it, CREATED is
/// applied, and PAID on its redelivery is applied after it, in order. An event whose earlier one
/// never comes is projected from PostgreSQL on its redelivery.
#[tokio::test]
async fn an_event_ahead_of_its_order_is_held_until_the_earlier_one_then_taken_from_postgres() {
    let env = TestEnv::without_topics().await;
    env.activity(9300, 1, 5).await;
    let names = env.names();
    let h = seckill::roles::consume::projection::ProjectionHandler {
        redis: env.redis().await,
        pool: env.pool(1).await,
        group: names.projection_group.clone(),
        deferral: None,
    };
    let ids = Ids::generate(1, 0);
    let ev = |version: i32, status: &str, reconsume_times: i32| {
        let body = serde_json::json!({
            "event_type": format!("ORDER_{status}"), "order_id": ids.order_id,
            "reservation_id": ids.reservation_id, "status": status, "aggregate_version": version,
            "user_id": 5,
        });
        let mut d = delivery(
            &names.order_event_topic,
            None,
            serde_json::to_vec(&body).unwrap(),
        );
        d.reconsume_times = reconsume_times;
        d
    };
    let redis = env.redis().await;
    let projected = || async {
        let p = redis
            .projections()
            .projection(&ids.reservation_id)
            .await
            .unwrap();
        (p.get("status").cloned(), p.get("version").cloned())
    };
    // PAID first: held (the batch goes back to the broker), nothing projected.
    assert_eq!(
        h.handle(vec![ev(2, "PAID", 0)]).await,
        seckill::mq::ConsumeDecision::Retry
    );
    assert_eq!(projected().await, (None, None));
    // CREATED comes: applied.
    assert_eq!(
        h.process(&[ev(1, "CREATED", 0)]).await.unwrap(),
        ["applied"]
    );
    assert_eq!(
        projected().await,
        (Some("CREATED".into()), Some("1".into()))
    );
    // PAID redelivered: applied after it.
    assert_eq!(
        h.handle(vec![ev(2, "PAID", 1)]).await,
        seckill::mq::ConsumeDecision::Ack
    );
    assert_eq!(projected().await, (Some("PAID".into()), Some("2".into())));

    // An order whose CREATED never reaches the projection: its PAID, redelivered, is projected
    // as PostgreSQL has the order.
    let order = created_orders(&env, 9300, 1).await.remove(0);
    let names_s = state_names(&env);
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    let paid = pay(&mut c, &payment(&order, "pay-9300"), &names_s)
        .await
        .unwrap();
    assert!(matches!(paid, PayOutcome::Paid { .. }), "{paid:?}");
    let (reservation, user): (String, i64) = {
        let r = c
            .query_one(
                "SELECT reservation_id, user_id FROM orders WHERE order_id = $1",
                &[&order],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    let body = serde_json::json!({
        "event_type": "ORDER_PAID", "order_id": order, "reservation_id": reservation,
        "status": "PAID", "aggregate_version": 2, "user_id": user,
    });
    let mut late = delivery(
        &names.order_event_topic,
        None,
        serde_json::to_vec(&body).unwrap(),
    );
    late.reconsume_times = 1;
    assert_eq!(h.process(&[late]).await.unwrap(), ["from_postgres"]);
    let p = redis.projections().projection(&reservation).await.unwrap();
    assert_eq!((p["status"].as_str(), p["version"].as_str()), ("PAID", "2"));
    drop(c);
    env.cleanup().await;
}
