//! Recovery paths on the real services: the scanner re-sends what the API never sent, the
//! outbox relay delivers (again, after a crash between send and mark), compensation releases
//! a reservation exactly once, the timeout cancel and the payment never both win.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use crate::common::{delivery, delivery_of, eventually, reserve_only, TestEnv};
use chrono::Utc;
use seckill::domain::{CancelOutcome, PayOutcome};
use seckill::domain::{Decision, RejectReason};
use seckill::domain::{Ids, OrderCreateRequested};
use seckill::mq::BatchHandler;
use seckill::pg::order_state::{pay, Payment, StateNames};

/// A payment of a test order (every test SKU costs 100 cents).
fn payment<'a>(order_id: &'a str, payment_id: &'a str) -> Payment<'a> {
    Payment {
        order_id,
        payment_id,
        amount_cents: 100,
    }
}
use seckill::pg::outbox;
use seckill::roles::consume::compensate::CompensationHandler;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::{outbox_message, Relay, Scanner};
use seckill::roles::timeout_cancel::TimeoutCancelHandler;

fn state_names(env: &TestEnv) -> StateNames {
    let n = env.names();
    StateNames {
        order_event_topic: n.order_event_topic,
        compensate_topic: n.compensate_topic,
    }
}

#[tokio::test]
async fn the_scanner_sends_what_the_api_never_sent_with_the_same_message_id() {
    let env = TestEnv::with_topics().await;
    env.activity(10, 1, 50).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();

    let lost = reserve_only(&redis, 10, 1, 0).await;
    let scanner = Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher.clone(),
        settings.clone(),
    );
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!((stats.claimed, stats.confirmed), (1, 1));
    eventually(30, "the order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let (mid, oid): (String, String) = {
        let r = c
            .query_one("SELECT message_id, order_id FROM consumer_inbox", &[])
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (mid, oid),
        (lost.message_id.clone(), lost.order_id.clone()),
        "same ids as reserved"
    );
    assert_eq!(
        redis.reservation(10, &lost.reservation_id).await.unwrap()["mq_status"],
        "MQ_SENT"
    );
    assert_eq!(
        scanner.scan_once().await.unwrap().claimed,
        0,
        "nothing left to send"
    );

    // Two scanners at once never take the same reservation.
    for user in 100..120 {
        reserve_only(&redis, 10, user, 0).await;
    }
    let a = Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher.clone(),
        settings.clone(),
    );
    let b = Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher.clone(),
        settings.clone(),
    );
    let (sa, sb) = tokio::join!(a.scan_once(), b.scan_once());
    let (sa, sb) = (sa.unwrap(), sb.unwrap());
    assert_eq!(sa.claimed + sb.claimed, 20, "{sa:?} {sb:?}");

    // A scanner that dies holding leases: nobody sends them until the lease expires.
    for user in 200..205 {
        reserve_only(&redis, 10, user, 0).await;
    }
    let held = redis
        .claim_due(10, Utc::now().timestamp_millis(), 100, "dead-scanner", 1500)
        .await
        .unwrap()
        .reservations;
    assert_eq!(held.len(), 5);
    assert_eq!(
        b.scan_once().await.unwrap().claimed,
        0,
        "leased to the dead scanner"
    );
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert_eq!(
        b.scan_once().await.unwrap().confirmed,
        5,
        "taken over after the lease"
    );

    eventually(30, "26 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 26
    })
    .await;
    common::quiescent(&env, 10).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        26,
        "one order each"
    );
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

/// The reservation's message reaches the order consumer after its validity ended: rejected
/// as expired, its release (compensation task and outbox row) written.
async fn rejected_as_expired(
    env: &TestEnv,
    redis: &seckill::redis::RedisStore,
    activity_id: i64,
    ids: &Ids,
) {
    let fields = redis
        .reservation(activity_id, &ids.reservation_id)
        .await
        .unwrap();
    let mut event: OrderCreateRequested =
        seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
    event.reservation_valid_until = Utc::now() - chrono::Duration::seconds(1);
    event.reservation_created_at = event.reservation_valid_until - chrono::Duration::seconds(300);
    let order_handler = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let d = delivery_of(&env.names().order_create_topic, &event);
    assert_eq!(
        order_handler.process(&[d]).await.unwrap(),
        vec![Decision::Rejected(RejectReason::Expired)]
    );
}

/// The compensation handler, and a consumer of the compensation topic running it.
async fn compensation_consumer(
    env: &TestEnv,
    redis: &seckill::redis::RedisStore,
) -> (
    Arc<CompensationHandler>,
    seckill::mq::rocketmq::ConsumerHandle,
) {
    let names = env.names();
    let comp = Arc::new(CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(2).await,
        group: names.compensate_group.clone(),
    });
    let consumer = seckill::mq::start_consumer(
        &env.settings,
        &names.compensate_group,
        &names.compensate_topic,
        comp.clone(),
        2,
        16,
    )
    .await
    .unwrap();
    (comp, consumer)
}

#[tokio::test]
async fn an_expired_backlog_is_compensated_once_through_the_relay_even_when_redelivered() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.relay_lease_secs = 1;
    env.activity(20, 1, 5).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let names = env.names();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();

    // The reservation's message reaches the consumer after its validity ended.
    let ids = reserve_only(&redis, 20, 7, 60_000).await;
    assert_eq!(redis.sku_stock(20, 1).await.unwrap(), Some((5, 4)));
    rejected_as_expired(&env, &redis, 20, &ids).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    let (comp, consumer) = compensation_consumer(&env, &redis).await;

    // A relay sends the compensation event and dies before marking it SENT ...
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let rows = outbox::claim(&**c, 10, 1.0).await.unwrap();
    assert_eq!(rows.len(), 1);
    let first = publisher.send(outbox_message(&rows[0]), 3000).await;
    assert!(
        matches!(first, seckill::mq::SendOutcome::Confirmed { .. }),
        "{first:?}"
    );
    // ... so after its lease another relay sends it again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let relay = Relay::new(env.pool(2).await, publisher.clone(), settings.clone());
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE status = 'SENT' AND broker_msg_id IS NOT NULL"
        )
        .await,
        1
    );

    eventually(30, "compensation done", || async {
        env.count("SELECT count(*) FROM compensation_tasks WHERE status = 'DONE'")
            .await
            == 1
    })
    .await;
    // And a third delivery straight to the handler.
    let payload = c
        .query_one("SELECT payload FROM event_outbox", &[])
        .await
        .unwrap()
        .get::<_, serde_json::Value>(0);
    let again = delivery(
        &names.compensate_topic,
        None,
        serde_json::to_vec(&payload).unwrap(),
    );
    assert_eq!(
        comp.process(std::slice::from_ref(&again)).await.unwrap(),
        ["already_released"]
    );
    // The relay's second send has been consumed too before the stock is read.
    common::caught_up(&env, &names.compensate_group, &names.compensate_topic).await;
    assert_eq!(
        redis.sku_stock(20, 1).await.unwrap(),
        Some((5, 5)),
        "released exactly once"
    );
    let fields = redis.reservation(20, &ids.reservation_id).await.unwrap();
    assert_eq!(fields["status"], "RELEASED");
    // The buyer may try again.
    reserve_only(&redis, 20, 7, 60_000).await;
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
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
    // One batch, one round trip: PAID (v2) overtakes CREATED (v1); v2 arrives twice; a poison
    // body among them is quarantined without failing the others.
    let poison = delivery(&names.order_event_topic, None, b"nope".to_vec());
    let batch = [ev(2, "PAID"), ev(1, "CREATED"), ev(2, "PAID"), poison];
    assert_eq!(
        h.process(&batch).await.unwrap(),
        ["applied", "stale", "stale", "quarantined"]
    );
    let redis = env.redis().await;
    let p = redis.projection(&ids.reservation_id).await.unwrap();
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
    let p = redis.projection(&ids.reservation_id).await.unwrap();
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
            .projection(&ids.reservation_id)
            .await
            .unwrap()
            .is_empty(),
        "nothing projected while held"
    );
    // Orders caught up (under half the threshold): the batch is applied and ACKed.
    assert!(!deferral.note_backlog(Duration::from_secs(4)));
    assert_eq!(handled.await.unwrap(), seckill::mq::ConsumeDecision::Ack);
    let p = redis.projection(&ids.reservation_id).await.unwrap();
    assert_eq!(p["status"], "CREATED");
    assert_eq!(deferral.holding(), 0);
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_of_releases_gives_each_unit_back_once_in_one_round_trip() {
    let env = TestEnv::without_topics().await;
    env.activity(21, 1, 5).await;
    let redis = env.redis().await;
    let names = env.names();
    let a = reserve_only(&redis, 21, 1, 60_000).await;
    let b = reserve_only(&redis, 21, 2, 60_000).await;
    assert_eq!(redis.sku_stock(21, 1).await.unwrap(), Some((5, 3)));
    let release = |ids: &Ids| {
        let body = serde_json::json!({
            "schema_version": 1, "event_type": "RELEASE_RESERVATION",
            "event_id": format!("{}.RELEASE", ids.reservation_id),
            "reservation_id": ids.reservation_id, "order_id": ids.order_id,
            "activity_id": 21, "sku_id": 1, "user_id": 1, "reason": "NO_STOCK",
        });
        delivery(
            &names.compensate_topic,
            None,
            serde_json::to_vec(&body).unwrap(),
        )
    };
    let comp = CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(1).await,
        group: names.compensate_group.clone(),
    };
    let batch = [
        release(&a),
        release(&b),
        release(&a),
        delivery(&names.compensate_topic, None, b"{".to_vec()),
    ];
    assert_eq!(
        comp.process(&batch).await.unwrap(),
        ["released", "released", "already_released", "quarantined"]
    );
    assert_eq!(redis.sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    // The whole batch again (a redelivery): nothing more comes back.
    let again = comp.process(&batch).await.unwrap();
    assert_eq!(
        again[..3],
        ["already_released", "already_released", "already_released"]
    );
    assert_eq!(redis.sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    env.cleanup().await;
}

#[tokio::test]
async fn an_outbox_row_that_never_sends_goes_dead_after_its_last_attempt() {
    let mut env = TestEnv::without_topics().await;
    env.settings.scan.relay_max_attempts = 2;
    env.settings.scan.relay_backoff_base_ms = 1;
    env.settings.scan.relay_backoff_cap_ms = 1;
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    // A topic the broker does not have: every send is a definite failure.
    c.execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, payload)
         VALUES ('evt-dead', 'NO_SUCH_TOPIC_FOR_SECKILL_TESTS', 'ORDER_PAID', 'ord_x', '{\"event_type\":\"ORDER_PAID\"}')",
        &[],
    )
    .await
    .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    let (s, a, e) = outbox_status(&c).await;
    assert_eq!((s.as_str(), a), ("PENDING", 1), "retried after a failure");
    assert!(e.is_some());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    let (s, a, _) = outbox_status(&c).await;
    assert_eq!((s.as_str(), a), ("DEAD", 2), "dead after the last attempt");
    assert_eq!(
        relay.relay_once().await.unwrap(),
        0,
        "a dead row is not sent again"
    );
    // The broker refused it (no such topic): it waits for an operator, the relay's own probe
    // never brings it back.
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE dead_reason = 'REFUSED'")
            .await,
        1
    );
    assert!(!relay.probe_dead().await.unwrap());
    drop(c);
    env.cleanup().await;
}

async fn outbox_status(c: &deadpool_postgres::Object) -> (String, i32, Option<String>) {
    let r = c
        .query_one("SELECT status, attempts, last_error FROM event_outbox", &[])
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// Counts the broker calls the relay makes through the real producer.
struct CallLog {
    inner: Arc<dyn seckill::mq::Publisher>,
    /// (method, messages) of each call.
    calls: std::sync::Mutex<Vec<(&'static str, Vec<seckill::mq::OutMessage>)>>,
}

#[async_trait::async_trait]
impl seckill::mq::Publisher for CallLog {
    async fn send(
        &self,
        msg: seckill::mq::OutMessage,
        timeout_ms: u64,
    ) -> seckill::mq::SendOutcome {
        self.calls.lock().unwrap().push(("send", vec![msg.clone()]));
        self.inner.send(msg, timeout_ms).await
    }
    async fn send_batch(
        &self,
        msgs: Vec<seckill::mq::OutMessage>,
        timeout_ms: u64,
    ) -> Vec<seckill::mq::SendOutcome> {
        self.calls
            .lock()
            .unwrap()
            .push(("send_batch", msgs.clone()));
        self.inner.send_batch(msgs, timeout_ms).await
    }
}

#[tokio::test]
async fn the_relay_sends_immediate_events_in_one_batch_call_in_version_order_and_timers_one_by_one()
{
    let env = TestEnv::with_topics().await;
    let names = env.names();
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let orders = 10;
    for i in 0..orders {
        let order = format!("ord_relay_{i}");
        for (version, tag) in [(1, "ORDER_CREATED"), (2, "ORDER_PAID")] {
            c.execute(
                "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
                 VALUES ($1, $2, $3, $4, $4, $5, jsonb_build_object('event_type', $3::text))",
                &[&format!("{order}.v{version}"), &names.order_event_topic, &tag, &order, &version],
            )
            .await
            .unwrap();
        }
        c.execute(
            "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, payload, deliver_at)
             VALUES ($1, $2, 'CANCEL_IF_UNPAID', $3, $3, '{\"event_type\":\"CANCEL_ORDER_IF_UNPAID\"}', now() + interval '10 minutes')",
            &[&format!("{order}.CANCEL_IF_UNPAID"), &names.order_timeout_topic, &order],
        )
        .await
        .unwrap();
    }
    let inner = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let log = Arc::new(CallLog {
        inner,
        calls: Default::default(),
    });
    let relay = Relay::new(
        env.pool(2).await,
        log.clone(),
        Arc::new(env.settings.clone()),
    );
    assert_eq!(relay.relay_once().await.unwrap(), orders * 3);

    let calls = log.calls.lock().unwrap().clone();
    let batches: Vec<_> = calls.iter().filter(|(k, _)| *k == "send_batch").collect();
    let singles: Vec<_> = calls.iter().filter(|(k, _)| *k == "send").collect();
    assert_eq!(batches.len(), 1, "the order events go out in one call");
    let batch = &batches[0].1;
    assert_eq!(batch.len(), orders * 2);
    assert!(batch.iter().all(|m| m.deliver_time_ms.is_none()));
    for i in 0..orders {
        let at = |v: i32| {
            batch
                .iter()
                .position(|m| {
                    m.keys == [format!("ord_relay_{i}")]
                        && m.properties
                            .contains(&("aggregate_version".into(), v.to_string()))
                })
                .expect("both versions in the batch")
        };
        assert!(at(1) < at(2), "an order's events leave in version order");
    }
    assert_eq!(singles.len(), orders, "a timer per call");
    assert!(singles.iter().all(|(_, m)| m[0].deliver_time_ms.is_some()));

    let rows = c
        .query("SELECT status, broker_msg_id FROM event_outbox", &[])
        .await
        .unwrap();
    let ids: std::collections::HashSet<String> = rows
        .iter()
        .map(|r| {
            assert_eq!(r.get::<_, String>(0), "SENT");
            r.get(1)
        })
        .collect();
    assert_eq!(ids.len(), orders * 3, "each row has its own broker id");
    assert!(!ids.contains(""));
    drop(c);
    env.cleanup().await;
}

#[tokio::test]
async fn an_activity_that_ended_long_ago_with_nothing_pending_leaves_the_scanners_list() {
    let env = TestEnv::without_topics().await;
    let redis = env.redis().await;
    let now = Utc::now().timestamp_millis();
    let hour = 3_600_000;
    // 31: ended two hours ago, nothing pending. 32: ended as long ago, one reservation still
    // pending (its re-send is not due yet). 33: still on sale, nothing pending. 34: ended just
    // now, nothing pending (an API host with a lagging clock could still reserve).
    for (activity, ends) in [
        (31, now - 2 * hour),
        (32, now - 2 * hour),
        (33, now + hour),
        (34, now - 1000),
    ] {
        redis
            .warm(activity, 1, now - 3 * hour, ends, 60_000, 5, 1)
            .await
            .unwrap();
    }
    let mut conn = redis.pool.get().await.unwrap();
    let _: () = redis::AsyncCommands::zadd(
        &mut *conn,
        redis.keys.pending(32),
        "rsv_not_due",
        now + hour,
    )
    .await
    .unwrap();
    drop(conn);

    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!((stats.retired, stats.claimed), (1, 0), "{stats:?}");
    let mut left = redis.activities().await.unwrap();
    left.sort();
    assert_eq!(left, vec![32, 33, 34]);
    assert_eq!(
        scanner.scan_once().await.unwrap().retired,
        0,
        "retired once"
    );
    // The retired activity's keys now expire (after retention.activity_keys_hours); the
    // others' do not.
    let keep = i64::from(env.settings.retention.activity_keys_hours) * 3600;
    let mut conn = redis.pool.get().await.unwrap();
    let ttl = |key: String| {
        let mut c = redis::cmd("TTL");
        c.arg(key);
        c
    };
    let retired: i64 = ttl(redis.keys.sku(31, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert!(retired > keep - 60 && retired <= keep, "TTL {retired}");
    let meta: i64 = ttl(redis.keys.meta(31))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert!(meta > 0, "TTL {meta}");
    let live: i64 = ttl(redis.keys.sku(33, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(live, -1, "a live activity's stock never expires");
    // Warming it again puts it back.
    redis
        .warm(31, 1, now - 3 * hour, now + hour, 60_000, 5, 1)
        .await
        .unwrap();
    assert!(redis.activities().await.unwrap().contains(&31));
    let revived: i64 = ttl(redis.keys.sku(31, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(revived, -1, "a sale warmed again no longer expires");
    drop(conn);
    env.cleanup().await;
}

/// A fixed reading of the order-create group's progress.
struct Progress(Option<i64>);

#[async_trait::async_trait]
impl seckill::roles::scan::unconsumed::ProgressReader for Progress {
    async fn taken_until_ms(&self) -> Option<i64> {
        self.0
    }
}

#[tokio::test]
async fn a_confirmed_send_the_consumers_never_took_is_sent_again_with_the_same_message_id() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.unconsumed_resend_ms = 1_000;
    env.activity(11, 1, 50).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let topic = env.names().order_create_topic;
    // Two reservations the broker confirmed 20 s ago; only the first copy reached the
    // consumers (the second one's broker died holding it: it was never sent here at all).
    let sent_at = Utc::now().timestamp_millis() - 20_000;
    let (taken, stranded) = (
        reserve_only(&redis, 11, 1, 60_000).await,
        reserve_only(&redis, 11, 2, 60_000).await,
    );
    for ids in [&taken, &stranded] {
        let verdict = redis
            .mark_sent(11, &ids.reservation_id, &ids.message_id, "b-1", sent_at)
            .await
            .unwrap();
        assert_eq!(verdict, "OK");
    }
    let fields = redis.reservation(11, &taken.reservation_id).await.unwrap();
    let event = seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
    let out = publisher
        .send(seckill::mq::order_create_message(&topic, &event), 3_000)
        .await;
    assert!(
        matches!(out, seckill::mq::SendOutcome::Confirmed { .. }),
        "{out:?}"
    );
    eventually(30, "the first order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let scanner_with = |progress: Option<i64>| {
        let (redis, publisher, settings) = (redis.clone(), publisher.clone(), settings.clone());
        let env = &env;
        async move {
            Scanner::new(redis, env.pool(1).await, publisher, settings)
                .with_progress(Arc::new(Progress(progress)))
        }
    };
    // No reading of the group's progress: nothing is sent blind.
    let blind = scanner_with(None).await;
    assert_eq!(
        blind.scan_once().await.unwrap().awaiting,
        Default::default()
    );
    // The group has taken everything only up to before the sends: both may still be in line.
    let behind = scanner_with(Some(sent_at - 1)).await;
    assert_eq!(
        behind.scan_once().await.unwrap().awaiting,
        Default::default()
    );
    // Caught up (whenever asked): the first is in the inbox (watched no more), the second is
    // sent again.
    let scanner = scanner_with(Some(i64::MAX)).await;
    let stats = scanner.scan_once().await.unwrap().awaiting;
    assert_eq!(
        (stats.consumed, stats.resent, stats.settled),
        (1, 1, 0),
        "{stats:?}"
    );
    eventually(30, "the stranded reservation's order", || async {
        env.count("SELECT count(*) FROM orders").await == 2
    })
    .await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let oid: String = c
        .query_one(
            "SELECT order_id FROM consumer_inbox WHERE message_id = $1",
            &[&stranded.message_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(oid, stranded.order_id, "the same ids as reserved");
    // Watched again from its new copy; once that is due, the inbox has it and the watch ends.
    let last = std::cell::Cell::new(Default::default());
    eventually(10, "the re-sent one seen consumed", || async {
        last.set(scanner.scan_once().await.unwrap().awaiting);
        last.get().consumed == 1
    })
    .await;
    assert_eq!(last.get().resent, 0, "{:?}", last.get());
    let k = &redis.keys;
    let mut conn = redis.pool.get().await.unwrap();
    let watched: i64 = deadpool_redis::redis::AsyncCommands::zcard(&mut *conn, k.awaiting(11))
        .await
        .unwrap();
    assert_eq!(watched, 0, "nothing left to watch");
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_confirmed_release_the_compensation_consumers_never_took_is_sent_again() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.unconsumed_resend_ms = 1_000;
    env.activity(21, 1, 5).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    // An expired reservation: rejected, its release in the outbox.
    let ids = reserve_only(&redis, 21, 7, 60_000).await;
    rejected_as_expired(&env, &redis, 21, &ids).await;
    // The relay sent it 20 s ago to a broker that died holding it: SENT, never delivered.
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let sent = c
        .execute(
            "UPDATE event_outbox SET status = 'SENT', sent_at = now() - interval '20 seconds',
                    broker_msg_id = 'on-a-dead-broker', created_at = now() - interval '20 seconds'
             WHERE tag = 'RELEASE_RESERVATION'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(sent, 1);
    c.execute(
        "UPDATE compensation_tasks SET created_at = now() - interval '20 seconds'",
        &[],
    )
    .await
    .unwrap();
    let (_, consumer) = compensation_consumer(&env, &redis).await;
    let relay_with = |progress: Option<i64>| {
        let (publisher, settings) = (publisher.clone(), settings.clone());
        let env = &env;
        async move {
            Relay::new(env.pool(2).await, publisher, settings)
                .with_release_progress(Arc::new(Progress(progress)))
        }
    };
    // No reading, or a group that has taken nothing since before the send: nothing is due.
    assert_eq!(
        relay_with(None).await.requeue_unconsumed().await.unwrap(),
        0
    );
    let behind = Utc::now().timestamp_millis() - 30_000;
    assert_eq!(
        relay_with(Some(behind))
            .await
            .requeue_unconsumed()
            .await
            .unwrap(),
        0
    );
    // Caught up, and the task still PENDING: sent again under the same event id.
    let relay = relay_with(Some(i64::MAX)).await;
    assert_eq!(relay.requeue_unconsumed().await.unwrap(), 1);
    assert_eq!(
        relay.requeue_unconsumed().await.unwrap(),
        0,
        "already back in line"
    );
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    eventually(30, "the unit given back", || async {
        env.count("SELECT count(*) FROM compensation_tasks WHERE status = 'DONE'")
            .await
            == 1
    })
    .await;
    assert_eq!(redis.sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    // Done: nothing more to send, however old the row.
    c.execute(
        "UPDATE event_outbox SET sent_at = now() - interval '20 seconds'",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(relay.requeue_unconsumed().await.unwrap(), 0);
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}
