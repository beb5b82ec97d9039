//! The broker in trouble: an unreachable one leaves the reservation pending with its stock
//! kept, a missing topic is a definite failure that releases it, a poison message is
//! quarantined and acknowledged, and admission
//! (docs/architecture/hot-path.md#fail-closed-admission) pauses an activity whose reservations
//! wait too long and resumes when they drain.

use crate::common;

use std::sync::Arc;

use super::start;
use crate::common::{eventually, reserve_as as reserve, TestEnv};
use reqwest::StatusCode;
use seckill::mq::OutMessage;
use seckill::roles::consume::order_create::OrderCreateHandler;

/// The real handler, with a count of the batches it acknowledged and sent back.
struct Deciding {
    inner: OrderCreateHandler,
    acks: std::sync::atomic::AtomicUsize,
    retries: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl seckill::mq::BatchHandler for Deciding {
    async fn handle(&self, batch: Vec<seckill::mq::Delivery>) -> seckill::mq::ConsumeDecision {
        let decision = self.inner.handle(batch).await;
        let counter = match decision {
            seckill::mq::ConsumeDecision::Ack => &self.acks,
            seckill::mq::ConsumeDecision::Retry => &self.retries,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        decision
    }
}

#[tokio::test]
async fn an_unreachable_broker_is_unknown_keeps_the_stock_and_leaves_the_reservation_pending() {
    let mut env = TestEnv::without_topics().await;
    env.activity(400, 1, 5).await;
    // Nothing listens on this port: the name server is dead.
    env.settings.mq.name_server = "127.0.0.1:1".into();
    env.settings.mq.send_timeout_ms = 300;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let app = start(&env, publisher, false).await;
    let (status, body) = reserve(&app.base, 400, 1, 9, "x").await;
    assert_eq!(status, StatusCode::ACCEPTED, "UNKNOWN still queues: {body}");
    let rid = body["reservation_id"].as_str().unwrap();
    let fields = app.state.redis.reservation(400, rid).await.unwrap();
    assert_eq!(fields["mq_status"], "MQ_PENDING");
    assert_eq!(fields["status"], "RESERVED");
    assert!(fields.contains_key("last_error"), "{fields:?}");
    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(400, 1).await.unwrap(),
        Some((5, 4)),
        "stock not given back"
    );
    assert_eq!(
        redis.recovery().pending_count(400).await.unwrap(),
        1,
        "left for the scanner"
    );
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_missing_topic_is_a_definite_failure_that_releases_the_reservation() {
    // No topics created for this environment, and the broker does not auto-create them.
    let env = TestEnv::without_topics().await;
    env.activity(500, 1, 5).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let app = start(&env, publisher, false).await;
    let (status, body) = reserve(&app.base, 500, 1, 9, "x").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "ORDER_QUEUE_UNAVAILABLE");
    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(500, 1).await.unwrap(),
        Some((5, 5)),
        "released exactly once"
    );
    assert_eq!(redis.recovery().pending_count(500).await.unwrap(), 0);
    let census = redis.stock().reservation_census(500, 1).await.unwrap();
    assert_eq!(census.by_status.get("RELEASED"), Some(&1));
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_poison_message_on_the_topic_is_quarantined_and_acknowledged() {
    let env = TestEnv::with_topics().await;
    env.activity(600, 1, 5).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let mut app = start(&env, publisher.clone(), false).await;
    let handler = Arc::new(Deciding {
        inner: OrderCreateHandler::new(env.pool(3).await, &env.settings, 2),
        acks: Default::default(),
        retries: Default::default(),
    });
    app.consumer = Some(
        seckill::mq::start_order_create_consumer(&env.settings, handler.clone(), 2)
            .await
            .expect("consumer starts"),
    );
    let outcome = publisher
        .send(
            OutMessage {
                topic: env.names().order_create_topic,
                tag: "CREATE_ORDER".into(),
                keys: vec!["poison".into()],
                properties: vec![("message_id".into(), "evt_poison".into())],
                body: b"{\"schema_version\": 1, \"truncated".to_vec(),
                deliver_time_ms: None,
                sharding_key: None,
            },
            3000,
        )
        .await;
    assert!(
        matches!(outcome, seckill::mq::SendOutcome::Confirmed { .. }),
        "{outcome:?}"
    );
    eventually(30, "the poison message is quarantined", || async {
        env.count("SELECT count(*) FROM quarantined_messages WHERE message_id = 'evt_poison'")
            .await
            == 1
    })
    .await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);
    // Acknowledged: the handler answered ACK (never RETRY, which would send it back for a
    // redelivery) and the group's committed offset passed it, so the broker has nothing left
    // to deliver again.
    let names = env.names();
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(
        (handler.acks.load(SeqCst), handler.retries.load(SeqCst)),
        (1, 0)
    );
    assert_eq!(
        env.count("SELECT count(*) FROM quarantined_messages").await,
        1
    );
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn admission_pauses_when_reservations_wait_too_long_and_resumes_when_they_drain() {
    let mut env = TestEnv::with_topics().await;
    env.settings.api.reservation_valid_secs = 4;
    env.settings.api.fail_closed_share = 0.25; // bound: 1 s
    env.settings.api.admission_check_ms = 100;
    env.settings.api.resume_ramp_secs = 0;
    env.activity(800, 1, 50).await;
    env.activity(801, 1, 50).await;
    // The broker is unreachable for this API: every send is UNKNOWN, reservations stay pending.
    let mut dead = env.settings.clone();
    dead.mq.name_server = "127.0.0.1:1".into();
    dead.mq.send_timeout_ms = 200;
    let publisher = seckill::mq::connect_publisher(&dead).await.unwrap();
    let app = start(&env, publisher, false).await;
    let (s, _) = reserve(&app.base, 800, 1, 1, "a").await;
    assert_eq!(s, StatusCode::ACCEPTED);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let (s, b) = reserve(&app.base, 800, 1, 2, "b").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert_eq!(b["error"]["code"], "SALE_PAUSED");
    let why = b["error"]["message"].as_str().unwrap();
    assert!(
        why.contains("activity 800") && why.contains("unconfirmed"),
        "{b}"
    );
    // Only that activity waits: another one's buyers are still taken (their sends are as
    // uncertain, but none has waited past the bound yet).
    let (s, b) = reserve(&app.base, 801, 1, 2, "b-801").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    // What the admin status reports (the metrics registry is shared with the other tests'
    // APIs in this process, so the state is read directly).
    assert!(app.state.admission.activity_paused(800).is_some());
    assert!(
        app.state.admission.paused().is_none(),
        "the API as a whole is open"
    );

    // The scanner, with a working broker, sends the backlog: admission resumes by itself.
    let good = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = seckill::roles::scan::Scanner::new(
        env.redis().await,
        env.pool(1).await,
        good,
        Arc::new(env.settings.clone()),
    );
    // The first re-send is due after the backoff; wait for it.
    eventually(10, "the scanner re-sent the backlog", || async {
        scanner.scan_once().await.unwrap();
        let redis = env.redis().await;
        redis.recovery().pending_count(800).await.unwrap() == 0
            && redis.recovery().pending_count(801).await.unwrap() == 0
    })
    .await;
    // The next admission check (every 100 ms) sees the backlog gone.
    eventually(10, "admission resumed", || async {
        reserve(&app.base, 800, 1, 3, "c").await.0 != StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    app.stop().await;
    env.cleanup().await;
}
