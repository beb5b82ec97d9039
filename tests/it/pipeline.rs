//! The hot path end to end on the real services: the API in-process on port 0, the real
//! RocketMQ producer and push consumer, PostgreSQL and Redis. Each test has its own schema,
//! key prefix and topics.

use crate::common;

use std::sync::Arc;

use crate::common::{eventually, reserve_as as reserve, TestEnv};
use reqwest::StatusCode;
use seckill::mq::{OutMessage, Publisher};
use seckill::roles::api::{build_state, serve, ApiState};
use seckill::roles::consume::order_create::OrderCreateHandler;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

struct Running {
    base: String,
    state: ApiState,
    stop: CancellationToken,
    consumer: Option<seckill::mq::rocketmq::ConsumerHandle>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        if let Some(c) = self.consumer {
            c.shutdown().await;
        }
    }
}

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

async fn start(env: &TestEnv, publisher: Arc<dyn Publisher>, with_consumer: bool) -> Running {
    let state = build_state(Arc::new(env.settings.clone()), publisher)
        .await
        .expect("api state");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(serve(listener, state.clone(), stop.clone()));
    let consumer = if with_consumer {
        let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
        Some(
            seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
                .await
                .expect("consumer starts"),
        )
    } else {
        None
    };
    Running {
        base,
        state,
        stop,
        consumer,
    }
}

/// A GET as buyer 1.
async fn get(url: String) -> (StatusCode, Value) {
    get_as(1, url).await
}

/// A GET as buyer `user`.
async fn get_as(user: i64, url: String) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .get(url)
        .header("authorization", common::bearer(user))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn every_202_is_recorded_mq_sent_and_found_by_id_before_its_order_exists() {
    // No consumer: each reservation is answered from its Redis hash, found through the
    // activity its id names. MQ_SENT is recorded for the requests whose sends were confirmed
    // together in one gathered round trip (docs/architecture/hot-path.md#the-hot-path), before
    // their 202.
    let env = TestEnv::with_topics().await;
    env.activity(120, 1, 40).await;
    let publisher = seckill::mq::hot_path_publisher(&env.settings)
        .await
        .unwrap();
    let app = start(&env, publisher, false).await;
    let answers =
        futures::future::join_all((1..=32).map(|user| reserve(&app.base, 120, 1, user, "burst")))
            .await;
    for (user, (status, body)) in (1..=32).zip(answers) {
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        let rid = body["reservation_id"].as_str().unwrap();
        let (status, rsv) = get_as(user, format!("{}/v1/reservations/{rid}", app.base)).await;
        assert_eq!(status, StatusCode::OK, "{rsv}");
        assert_eq!(
            (rsv["status"].as_str(), rsv["mq_status"].as_str()),
            (Some("QUEUED"), Some("MQ_SENT")),
            "{rsv}"
        );
    }
    let redis = env.redis().await;
    assert_eq!(redis.pending_count(120).await.unwrap(), 0);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_reservation_becomes_one_created_order_visible_through_the_api() {
    let env = TestEnv::with_topics().await;
    env.activity(100, 1, 5).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let app = start(&env, publisher, true).await;

    let (status, body) = reserve(&app.base, 100, 1, 42, "r-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["status"], "QUEUED");
    let rid = body["reservation_id"].as_str().unwrap().to_string();
    let oid = body["order_id"].as_str().unwrap().to_string();

    let url = format!("{}/v1/orders/{oid}", app.base);
    eventually(30, "the order exists", || {
        let url = url.clone();
        async move { get_as(42, url).await.0 == StatusCode::OK }
    })
    .await;
    let (_, order) = get_as(42, url).await;
    assert_eq!(order["status"], "CREATED");
    assert_eq!(order["reservation_id"], rid.as_str());
    assert_eq!(order["user_id"], 42);
    let (status, rsv) = get_as(42, format!("{}/v1/reservations/{rid}", app.base)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(rsv["status"], "CREATED");
    assert_eq!(rsv["order_id"], oid.as_str());

    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM event_outbox").await, 2);

    // Payment (the provider's signed notification): paid once, the same notification again
    // is the same answer, another payment for the same order is refused.
    let pay = |payment: &'static str| common::notify_payment(&app.base, &oid, payment, 100);
    let (s, b) = pay("p-1").await;
    assert_eq!(
        (s, b["status"].as_str(), b["repeat"].as_bool()),
        (StatusCode::OK, Some("PAID"), Some(false))
    );
    let (s, b) = pay("p-1").await;
    assert_eq!((s, b["repeat"].as_bool()), (StatusCode::OK, Some(true)));
    let (s, b) = pay("p-2").await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ALREADY_PAID"))
    );
    let (s, b) = pay("").await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST"))
    );
    // The buyer's own route to mark an order paid is gone: only the provider confirms.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/orders/{oid}/pay", app.base))
        .header("authorization", common::bearer(42))
        .json(&json!({"payment_id": "p-3"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'")
            .await,
        1
    );
    let (_, order) = get_as(42, format!("{}/v1/orders/{oid}", app.base)).await;
    assert_eq!(order["status"], "PAID");
    let fields = app.state.redis.reservation(100, &rid).await.unwrap();
    assert_eq!(fields["mq_status"], "MQ_SENT");
    let redis = env.redis().await;
    assert_eq!(redis.pending_count(100).await.unwrap(), 0);
    let report = env.invariants(100, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_request_id_reused_on_another_sku_is_refused_and_changes_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity_skus(210, &[(1, 5), (2, 5)]).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let app = start(&env, publisher, true).await;

    let (s1, b1) = reserve(&app.base, 210, 1, 7, "cart-1").await;
    assert_eq!(s1, StatusCode::ACCEPTED, "{b1}");
    // The same request id on the other SKU: neither the first SKU's reservation nor a new one.
    let (s2, b2) = reserve(&app.base, 210, 2, 7, "cart-1").await;
    assert_eq!(s2, StatusCode::CONFLICT, "{b2}");
    assert_eq!(b2["error"]["code"], "REQUEST_ID_REUSED");
    let redis = env.redis().await;
    assert_eq!(
        redis.sku_stock(210, 2).await.unwrap(),
        Some((5, 5)),
        "nothing reserved"
    );
    // Still a repeat on its own SKU, and a new id buys the other SKU.
    let (s3, b3) = reserve(&app.base, 210, 1, 7, "cart-1").await;
    assert_eq!(
        (s3, &b3["reservation_id"]),
        (StatusCode::ACCEPTED, &b1["reservation_id"])
    );
    let (s4, b4) = reserve(&app.base, 210, 2, 7, "cart-2").await;
    assert_eq!(s4, StatusCode::ACCEPTED, "{b4}");
    eventually(30, "2 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 2
    })
    .await;
    for sku in [1, 2] {
        let report = env.invariants(210, sku).await;
        assert!(report.ok(), "{:?}", report.violations);
    }
    app.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn repeats_second_purchases_and_sell_out_are_answered_and_never_oversold() {
    let env = TestEnv::with_topics().await;
    env.activity(200, 1, 3).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let app = start(&env, publisher, true).await;

    let (s1, b1) = reserve(&app.base, 200, 1, 1, "same").await;
    let (s2, b2) = reserve(&app.base, 200, 1, 1, "same").await;
    assert_eq!((s1, s2), (StatusCode::ACCEPTED, StatusCode::ACCEPTED));
    assert_eq!(
        b1["reservation_id"], b2["reservation_id"],
        "same request, same reservation"
    );
    assert_eq!(b2["duplicate"], true);
    let (s3, b3) = reserve(&app.base, 200, 1, 1, "another").await;
    assert_eq!(s3, StatusCode::CONFLICT);
    assert_eq!(b3["error"]["code"], "ALREADY_PURCHASED");

    let mut accepted = 1;
    let mut sold_out = 0;
    for user in 2..=8 {
        let (s, b) = reserve(&app.base, 200, 1, user, &format!("u{user}")).await;
        match s {
            StatusCode::ACCEPTED => accepted += 1,
            StatusCode::GONE => {
                assert_eq!(b["error"]["code"], "SOLD_OUT");
                sold_out += 1
            }
            other => panic!("unexpected {other}: {b}"),
        }
    }
    assert_eq!((accepted, sold_out), (3, 5));
    eventually(30, "3 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 3
    })
    .await;
    // Every message consumed and nothing left to re-send: no stray duplicate can still come.
    common::quiescent(&env, 200).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    let report = env.invariants(200, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    app.stop().await;
    env.cleanup().await;
}

/// Bodies the reservation route must refuse with 400, each with what it tries.
fn bad_bodies() -> Vec<(String, &'static str)> {
    let big = format!(
        r#"{{"user_id":1,"request_id":"{}","quantity":1}}"#,
        "a".repeat(10_000)
    );
    vec![
        ("{not json".into(), "json"),
        ("".into(), "empty"),
        (r#"{"user_id":1,"quantity":1}"#.into(), "missing request_id"),
        (
            r#"{"user_id":0,"request_id":"a","quantity":1}"#.into(),
            "zero user",
        ),
        (
            r#"{"user_id":-3,"request_id":"a","quantity":1}"#.into(),
            "negative user",
        ),
        (
            r#"{"user_id":1,"request_id":"a","quantity":2}"#.into(),
            "quantity 2",
        ),
        (
            r#"{"user_id":1e400,"request_id":"a","quantity":1}"#.into(),
            "overflow",
        ),
        (big, "oversized"),
        (r#"[1,"arr-1",1]"#.into(), "positional array"),
        ("null".into(), "null"),
        (r#""a string""#.into(), "bare string"),
        (
            r#"{"user_id":true,"request_id":"a","quantity":1}"#.into(),
            "bool user",
        ),
        (
            r#"{"user_id":1.5,"request_id":"a","quantity":1}"#.into(),
            "fractional user",
        ),
        (
            r#"{"user_id":9223372036854775808,"request_id":"a","quantity":1}"#.into(),
            "user past i64",
        ),
        (
            r#"{"user_id":1,"request_id":"a","quantity":-1}"#.into(),
            "negative quantity",
        ),
        (
            r#"{"user_id":1,"request_id":"a","quantity":4294967297}"#.into(),
            "quantity past u32",
        ),
        (
            r#"{"user_id":1,"request_id":"\u0000\ud83d\ude00","quantity":1}"#.into(),
            "control and emoji request id",
        ),
        (
            "{\"user_id\":1,\"request_id\":\"\u{e4}\u{20ac}\u{1d11e}\",\"quantity\":1}".into(),
            "unicode request id",
        ),
        (
            r#"{"user_id":1,"request_id":{"nested":[1,2,3]},"quantity":1}"#.into(),
            "object request id",
        ),
        (
            format!("{}1{}", "[".repeat(3000), "]".repeat(3000)),
            "deep nesting",
        ),
        ("\u{feff}{}".into(), "byte order mark"),
    ]
}

#[tokio::test]
async fn bad_input_gets_a_400_json_error_and_writes_nothing() {
    let env = TestEnv::without_topics().await;
    env.activity(300, 1, 5).await;
    // No broker involvement: nothing may get that far.
    let publisher: Arc<dyn Publisher> = Arc::new(NeverCalled);
    let app = start(&env, publisher, false).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/activities/300/skus/1/reservations", app.base);
    let bodies = bad_bodies();
    for (body, what) in bodies {
        let r = client
            .post(&url)
            .header("authorization", common::bearer(1))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "INVALID_REQUEST", "{what}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    for path in [
        "/v1/activities/-1/skus/1/reservations",
        "/v1/activities/abc/skus/1/reservations",
        "/v1/activities/300/skus/0/reservations",
        "/v1/activities/+300/skus/1/reservations",
        "/v1/activities/0300/skus/1/reservations",
        "/v1/activities/99999999999999999999/skus/1/reservations",
        "/v1/activities/%FF/skus/1/reservations",
        "/v1/activities/%E2%82%AC/skus/1/reservations",
    ] {
        let r = client
            .post(format!("{}{path}", app.base))
            .header("authorization", common::bearer(1))
            .json(&json!({"user_id": 1, "request_id": "a", "quantity": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "INVALID_REQUEST", "{path}: {v}");
    }
    // Hostile headers: a huge one, a garbage trace context; a 4xx, never a 5xx.
    let r = client
        .post(&url)
        .header("x-filler", "x".repeat(60_000))
        .header("traceparent", "00-zzzz-00-ff")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    for path in [
        "/v1/reservations/%FF",
        "/v1/orders/%FF",
        "/v1/orders/ord_%00",
    ] {
        let (s, b) = get(format!("{}{path}", app.base)).await;
        assert_eq!(
            (s, b["error"]["code"].as_str()),
            (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST")),
            "{path}"
        );
    }
    let (s, b) = get(format!("{}/v1/reservations/not-an-id", app.base)).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST"))
    );
    let (s, b) = get(format!("{}/no/such/route", app.base)).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("NOT_FOUND"))
    );
    let redis = env.redis().await;
    assert_eq!(redis.sku_stock(300, 1).await.unwrap(), Some((5, 5)));
    assert_eq!(
        redis
            .reservation_census(300, 1)
            .await
            .unwrap()
            .by_status
            .len(),
        0
    );
    app.stop().await;
    env.cleanup().await;
}

/// A publisher that must never be reached.
struct NeverCalled;

#[async_trait::async_trait]
impl Publisher for NeverCalled {
    async fn send(&self, _msg: OutMessage, _timeout_ms: u64) -> seckill::mq::SendOutcome {
        panic!("bad input reached the broker")
    }
    async fn send_batch(
        &self,
        _msgs: Vec<OutMessage>,
        _timeout_ms: u64,
    ) -> Vec<seckill::mq::SendOutcome> {
        panic!("bad input reached the broker")
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
        redis.sku_stock(400, 1).await.unwrap(),
        Some((5, 4)),
        "stock not given back"
    );
    assert_eq!(
        redis.pending_count(400).await.unwrap(),
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
        redis.sku_stock(500, 1).await.unwrap(),
        Some((5, 5)),
        "released exactly once"
    );
    assert_eq!(redis.pending_count(500).await.unwrap(), 0);
    let census = redis.reservation_census(500, 1).await.unwrap();
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
        redis.pending_count(800).await.unwrap() == 0 && redis.pending_count(801).await.unwrap() == 0
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
