//! Processes killed at the injection points of
//! docs/architecture/invariants.md#fault-injection-points (built with `--features failpoints`,
//! which `make test` uses): the real binary aborts at the failpoint like a SIGKILL, and the
//! recovery path finishes the work with exactly one effect.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, free_port, spawn, wait_ready, TestEnv};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery};
use seckill::roles::consume::order_create::OrderCreateHandler;
use serde_json::json;

#[tokio::test]
async fn api_killed_after_the_reservation_before_the_send_the_scanner_sends_it_once() {
    let env = TestEnv::with_topics().await;
    env.activity(900, 1, 5).await;
    let port = free_port();
    let mut api = spawn(
        &env,
        &["api"],
        "api-after-reserve-before-send=return",
        &[("SECKILL__API__LISTEN", format!("127.0.0.1:{port}"))],
    );
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let r = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{port}/v1/activities/900/skus/1/reservations"
        ))
        .header("authorization", common::bearer(5))
        .json(&json!({"user_id": 5, "request_id": "killed", "quantity": 1}))
        .send()
        .await;
    assert!(r.is_err(), "the process died mid-request: {r:?}");
    let status = api.wait_exit(10).await;
    assert!(!status.success(), "aborted: {status:?}");

    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(900, 1).await.unwrap(),
        Some((5, 4)),
        "reserved, not released"
    );
    assert_eq!(redis.recovery().pending_count(900).await.unwrap(), 1);
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = seckill::roles::scan::Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    eventually(20, "the scanner sent it", || async {
        scanner.scan_once().await.unwrap().confirmed == 1
    })
    .await;
    eventually(30, "one order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let census = redis.stock().reservation_census(900, 1).await.unwrap();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let mid: String = c
        .query_one("SELECT message_id FROM reservations", &[])
        .await
        .unwrap()
        .get(0);
    let fields = redis
        .reservation(900, &census.reserved_ids[0])
        .await
        .unwrap();
    assert_eq!(
        fields["message_id"], mid,
        "the message_id minted before the crash"
    );
    let report = env.invariants(900, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

/// Counts what the broker hands over and what the real handler finished deciding (ACK).
struct Counting {
    inner: OrderCreateHandler,
    seen: AtomicUsize,
    acked: AtomicUsize,
}

#[async_trait::async_trait]
impl BatchHandler for Counting {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let n = batch.len();
        self.seen.fetch_add(n, Ordering::SeqCst);
        let decision = self.inner.handle(batch).await;
        if decision == ConsumeDecision::Ack {
            self.acked.fetch_add(n, Ordering::SeqCst);
        }
        decision
    }
}

#[tokio::test]
async fn consumer_killed_after_commit_before_ack_the_redelivery_hits_the_inbox() {
    let env = TestEnv::with_topics().await;
    env.activity(901, 1, 5).await;
    let (mut consumer, mport) =
        common::spawn_consume(&env, "1", "consume-after-commit-before-ack=return");
    wait_ready(format!("http://127.0.0.1:{mport}/readyz")).await;
    // One reservation through the real hot path, in-process.
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(env.settings.clone()), publisher)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(seckill::roles::api::serve(listener, state, stop.clone()));
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/activities/901/skus/1/reservations"))
        .header("authorization", common::bearer(8))
        .json(&json!({"user_id": 8, "request_id": "r", "quantity": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::ACCEPTED);
    let status = consumer.wait_exit(30).await;
    assert!(!status.success(), "aborted after the commit: {status:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "committed before the crash"
    );

    let handler = Arc::new(Counting {
        inner: OrderCreateHandler::new(env.pool(2).await, &env.settings, 1),
        seen: AtomicUsize::new(0),
        acked: AtomicUsize::new(0),
    });
    let again = seckill::mq::start_order_create_consumer(&env.settings, handler.clone(), 1)
        .await
        .unwrap();
    // The redelivery's own transaction has finished (its decision taken) before counting.
    eventually(
        60,
        "the un-ACKed message is redelivered and decided",
        || async { handler.acked.load(Ordering::SeqCst) >= 1 },
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "the inbox absorbed it"
    );
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    again.shutdown().await;
    stop.cancel();
    env.cleanup().await;
}

/// A relay killed after sending an outbox row but before marking it: a healthy relay sends the row
/// again after the lease, and the unit is released exactly once.
///
/// One story: the second relay sends the row the killed one left unmarked, and the checks count
/// what both sends delivered.
#[tokio::test]
async fn relay_killed_after_the_send_before_the_mark_sends_again_and_is_applied_once() {
    let env = TestEnv::with_topics().await;
    env.activity(902, 1, 5).await;
    let names = env.names();
    // An expired reservation: the order transaction rejects it and writes one compensation
    // event to the outbox (a RELEASE_RESERVATION for the Redis unit).
    let redis = env.redis().await;
    let ids = common::reserve_only(&redis, 902, 3, 600_000).await;
    let fields = redis.reservation(902, &ids.reservation_id).await.unwrap();
    let mut event = seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
    event.reservation_valid_until = chrono::Utc::now() - chrono::Duration::seconds(1);
    event.reservation_created_at = event.reservation_valid_until - chrono::Duration::seconds(300);
    OrderCreateHandler::new(env.pool(2).await, &env.settings, 1)
        .process(&[common::delivery_of(&names.order_create_topic, &event)])
        .await
        .unwrap();
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'PENDING'")
            .await,
        1
    );

    let comp = Arc::new(seckill::roles::consume::compensate::CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(2).await,
        group: names.compensate_group.clone(),
    });
    let counting_seen = Arc::new(AtomicUsize::new(0));
    struct CountComp(
        Arc<seckill::roles::consume::compensate::CompensationHandler>,
        Arc<AtomicUsize>,
    );
    #[async_trait::async_trait]
    impl BatchHandler for CountComp {
        async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
            self.1.fetch_add(batch.len(), Ordering::SeqCst);
            self.0.handle(batch).await
        }
    }
    let consumer = seckill::mq::start_consumer(
        &env.settings,
        &names.compensate_group,
        &names.compensate_topic,
        Arc::new(CountComp(comp, counting_seen.clone())),
        1,
        16,
    )
    .await
    .unwrap();

    // The relay sends, then dies before marking the row SENT.
    let port = free_port();
    let lease = [
        ("SECKILL__SCAN__METRICS_LISTEN", format!("127.0.0.1:{port}")),
        ("SECKILL__SCAN__RELAY_LEASE_SECS", "2".to_string()),
    ];
    let mut scan = spawn(
        &env,
        &["scan"],
        "relay-after-send-before-mark=return",
        &lease,
    );
    let status = scan.wait_exit(30).await;
    assert!(!status.success(), "aborted after the send: {status:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'PENDING'")
            .await,
        1,
        "not marked"
    );

    // A healthy relay sends it again once the lease is over and marks it.
    let port = free_port();
    let lease = [
        ("SECKILL__SCAN__METRICS_LISTEN", format!("127.0.0.1:{port}")),
        ("SECKILL__SCAN__RELAY_LEASE_SECS", "2".to_string()),
    ];
    let _scan = spawn(&env, &["scan"], "", &lease);
    eventually(30, "marked SENT", || async {
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'SENT'")
            .await
            == 1
    })
    .await;
    eventually(30, "both copies delivered", || async {
        counting_seen.load(Ordering::SeqCst) >= 2
    })
    .await;
    assert_eq!(
        redis.stock().sku_stock(902, 1).await.unwrap(),
        Some((5, 5)),
        "released exactly once"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE status = 'DONE'")
            .await,
        1
    );
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_scanner_killed_holding_leases_is_taken_over_after_they_expire() {
    let env = TestEnv::with_topics().await;
    env.activity(903, 1, 10).await;
    let redis = env.redis().await;
    for user in 1..=4 {
        common::reserve_only(&redis, 903, user, 0).await;
    }
    let port = free_port();
    let env_vars = [
        ("SECKILL__SCAN__METRICS_LISTEN", format!("127.0.0.1:{port}")),
        ("SECKILL__SCAN__SCANNER_LEASE_MS", "8000".to_string()),
    ];
    let mut scan = spawn(&env, &["scan"], "scanner-holding-lease=return", &env_vars);
    let status = scan.wait_exit(30).await;
    assert!(!status.success(), "aborted holding leases: {status:?}");
    let fields = redis
        .reservation(
            903,
            &redis
                .stock()
                .reservation_census(903, 1)
                .await
                .unwrap()
                .reserved_ids[0],
        )
        .await
        .unwrap();
    assert!(fields["lease_owner"].starts_with("scanner-"), "{fields:?}");
    let lease_until: i64 = fields["lease_until"].parse().unwrap();

    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let other = seckill::roles::scan::Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    // Judged against the lease's own expiry, not a guess of how long the steps above take.
    let claimed = other.scan_once().await.unwrap().claimed;
    if chrono::Utc::now().timestamp_millis() < lease_until - 100 {
        assert_eq!(claimed, 0, "still leased to the dead scanner");
    }
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let wait = lease_until + 300 - chrono::Utc::now().timestamp_millis();
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
    if claimed == 0 {
        assert_eq!(other.scan_once().await.unwrap().confirmed, 4, "taken over");
    }
    eventually(30, "4 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 4
    })
    .await;
    common::quiescent(&env, 903).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 4);
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_message_failing_its_batch_does_not_hold_back_the_others() {
    let env = TestEnv::without_topics().await;
    env.activity(960, 1, 10).await;
    let h = OrderCreateHandler::new(env.pool(3).await, &env.settings, 2);
    let topic = env.names().order_create_topic;
    let events: Vec<_> = (1..=5).map(|u| common::event(960, 1, u, 300)).collect();
    let batch: Vec<Delivery> = events
        .iter()
        .map(|e| common::delivery_of(&topic, e))
        .collect();
    let bad = events[2].message_id.clone();
    fail::cfg("order-tx-fails-for-message", &format!("return({bad})")).unwrap();

    // The batch transaction fails; split, the four others commit, the batch is redelivered.
    assert_eq!(h.handle(batch.clone()).await, ConsumeDecision::Retry);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 4);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM orders WHERE reservation_id = '{}'",
            events[2].reservation_id
        ))
        .await,
        0
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM consumer_failures WHERE message_id = '{bad}'"
        ))
        .await,
        1,
        "the failing message's error is recorded for the DLQ"
    );

    // Redelivered while it still fails: still four orders, nothing doubled.
    assert_eq!(h.handle(batch.clone()).await, ConsumeDecision::Retry);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 4);

    // The cause goes away: the whole batch is acknowledged, the fifth order appears once.
    fail::remove("order-tx-fails-for-message");
    assert_eq!(h.handle(batch).await, ConsumeDecision::Ack);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 5);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 5);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        5
    );
    env.cleanup().await;
}

#[tokio::test]
async fn api_killed_after_the_broker_stored_the_message_makes_one_order() {
    let env = TestEnv::with_topics().await;
    env.activity(961, 1, 5).await;
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let port = free_port();
    let mut api = spawn(
        &env,
        &["api"],
        "api-after-send-before-mark=return",
        &[("SECKILL__API__LISTEN", format!("127.0.0.1:{port}"))],
    );
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let r = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{port}/v1/activities/961/skus/1/reservations"
        ))
        .header("authorization", common::bearer(6))
        .json(&json!({"user_id": 6, "request_id": "stored-then-killed", "quantity": 1}))
        .send()
        .await;
    assert!(r.is_err(), "the process died before answering: {r:?}");
    assert!(!api.wait_exit(10).await.success());

    // The broker had it: the order appears although nobody recorded the send.
    eventually(30, "the order from the stored message", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let redis = env.redis().await;
    assert_eq!(
        redis.recovery().pending_count(961).await.unwrap(),
        1,
        "Redis never learnt of the send"
    );
    // The scanner re-sends it (same message_id): the consumer's inbox absorbs it.
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = seckill::roles::scan::Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    eventually(20, "the scanner re-sent it", || async {
        scanner.scan_once().await.unwrap().confirmed == 1
    })
    .await;
    eventually(30, "the duplicate reached the inbox", || async {
        env.count("SELECT count(*) FROM consumer_inbox").await == 1
            && redis.recovery().pending_count(961).await.unwrap() == 0
    })
    .await;
    common::quiescent(&env, 961).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    let report = env.invariants(961, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn consumer_killed_inside_the_transaction_commits_nothing_and_the_redelivery_creates_it() {
    let env = TestEnv::with_topics().await;
    env.activity(962, 1, 5).await;
    let (mut consumer, mport) =
        common::spawn_consume(&env, "1", "consume-inside-transaction=return");
    wait_ready(format!("http://127.0.0.1:{mport}/readyz")).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let e = common::event(962, 1, 9, 300);
    let sent = publisher
        .send(
            seckill::mq::order_create_message(&env.names().order_create_topic, &e),
            3000,
        )
        .await;
    assert!(matches!(sent, seckill::mq::SendOutcome::Confirmed { .. }));
    assert!(
        !consumer.wait_exit(30).await.success(),
        "aborted mid-transaction"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        0,
        "rolled back"
    );
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 0);

    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let again = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    eventually(60, "the redelivered message makes the order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        4
    );
    again.shutdown().await;
    env.cleanup().await;
}

/// A re-send the broker refuses keeps a valid reservation, to be tried again, and settles an
/// expired one: its inbox fenced, its rejection recorded, its unit back.
///
/// One story: one scan pass meets both reservations, and the checks read what that pass did to
/// each.
#[tokio::test]
async fn a_re_send_the_broker_refuses_keeps_a_valid_reservation_and_settles_an_expired_one() {
    // No topics for this environment: every send is refused ("topic route not found"), which is
    // also what a broker answers for a while after it restarts.
    let env = TestEnv::without_topics().await;
    env.activity(963, 1, 5).await;
    let redis = env.redis().await;
    let valid = common::reserve_only(&redis, 963, 1, 0).await;
    let expired = common::reserve_only(&redis, 963, 2, 0).await;
    {
        use deadpool_redis::redis::AsyncCommands;
        // Past its validity and the settle grace.
        let past = chrono::Utc::now().timestamp_millis()
            - env.settings.scan.settle_grace_ms as i64
            - 1_000;
        let mut c = redis.pool.get().await.unwrap();
        let _: () = c
            .hset(
                redis.keys.reservation(963, &expired.reservation_id),
                "valid_until",
                past,
            )
            .await
            .unwrap();
    }
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = seckill::roles::scan::Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!(
        (stats.failed, stats.settled),
        (1, 1),
        "both re-sends refused, the expired one settled: {stats:?}"
    );

    // The buyer of the valid one was told 202: it keeps its unit and is tried again later.
    let v = redis.reservation(963, &valid.reservation_id).await.unwrap();
    assert_eq!(
        (v["status"].as_str(), v["mq_status"].as_str()),
        ("RESERVED", "MQ_PENDING"),
        "{v:?}"
    );
    assert!(v["next_retry_at"].parse::<i64>().unwrap() > chrono::Utc::now().timestamp_millis());
    assert_eq!(redis.recovery().pending_count(963).await.unwrap(), 1);
    // The expired one: no copy reached the consumer, so its inbox is fenced (a copy arriving
    // later is a duplicate), the decision recorded, and the unit goes back.
    let e = redis
        .reservation(963, &expired.reservation_id)
        .await
        .unwrap();
    assert_eq!(
        (
            e["status"].as_str(),
            e["mq_status"].as_str(),
            e["release_reason"].as_str()
        ),
        ("RELEASED", "MQ_FENCED", "SEND_FENCED"),
        "{e:?}"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM reservations WHERE reservation_id = '{}' AND status = 'REJECTED' AND reject_reason = 'WITHDRAWN'",
            expired.reservation_id
        ))
        .await,
        1
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM consumer_inbox WHERE message_id = '{}'",
            expired.message_id
        ))
        .await,
        1
    );
    assert_eq!(redis.stock().sku_stock(963, 1).await.unwrap(), Some((5, 4)));
    env.cleanup().await;
}
