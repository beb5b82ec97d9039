//! The operators' side of the trust boundary (docs/architecture/security.md#admin-surface): the
//! admin listener needs its token, pause and resume reach every buyer at once, each action leaves
//! an audit row; DEAD outbox rows come back by themselves once the broker answers; an unreadable
//! order-queue lag closes admission.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::common::{admin_call, bearer, created_orders, eventually, TestEnv};
use reqwest::StatusCode;
use seckill::mq::{OutMessage, Publisher, SendOutcome};
use seckill::roles::scan::Relay;
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "test-admin-token-0123456789-abcdef-0123";

async fn start_with_admin(env: &TestEnv) -> common::AdminApi {
    common::start_with_admin(env, ADMIN_TOKEN).await
}

async fn reserve(base: &str, activity: i64, sku: i64, user: i64) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/{sku}/reservations"
        ))
        .header("authorization", bearer(user))
        .json(&json!({"request_id": format!("r-{user}-{sku}"), "quantity": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The admin listener refuses every caller without the admin token (none, a wrong one, a
/// buyer's) and audits nothing of them; the buyers' listener has no admin route at all.
#[tokio::test]
async fn admin_routes_refuse_every_caller_without_the_admin_token() {
    let env = TestEnv::with_topics().await;
    env.activity_skus(1200, &[(1, 10), (2, 10)]).await;
    let apis = start_with_admin(&env).await;
    let post = reqwest::Method::POST;
    let pause_url = format!("{}/admin/v1/sales/1200/pause", apis.admin);
    let status_url = format!("{}/admin/v1/sales/1200", apis.admin);

    // Without the token, with a wrong one, or with a buyer's token: 401, nothing done (past
    // five failures the address is throttled: 429, nothing done either; tests/it/front_door.rs).
    let buyer_token = bearer(1).trim_start_matches("Bearer ").to_string();
    let refused = |s: StatusCode, b: &Value| {
        assert!(
            matches!(
                (s, b["error"]["code"].as_str()),
                (StatusCode::UNAUTHORIZED, Some("UNAUTHENTICATED"))
                    | (StatusCode::TOO_MANY_REQUESTS, Some("RATE_LIMITED"))
            ),
            "{s} {b}"
        )
    };
    for token in [None, Some("wrong"), Some(buyer_token.as_str())] {
        let (s, b) = admin_call(
            post.clone(),
            pause_url.clone(),
            token,
            Some(json!({"reason": "x"})),
        )
        .await;
        refused(s, &b);
        let (s, b) = admin_call(reqwest::Method::GET, status_url.clone(), token, None).await;
        refused(s, &b);
        let (s, b) = admin_call(
            post.clone(),
            format!("{}/admin/v1/outbox/requeue", apis.admin),
            token,
            Some(json!({"all_dead": true})),
        )
        .await;
        refused(s, &b);
    }
    assert_eq!(env.count("SELECT count(*) FROM admin_audit").await, 0);
    // The admin routes are not on the buyers' listener at all.
    let (s, _) = admin_call(
        post.clone(),
        format!("{}/admin/v1/sales/1200/pause", apis.base),
        Some(ADMIN_TOKEN),
        Some(json!({"reason": "x"})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    apis.stop.cancel();
    env.cleanup().await;
}

/// An operator's pause reaches every buyer with its reason until resumed, a SKU's pause only
/// that SKU's buyers, and each action leaves its audit row.
/// One story: the pause, the resume and the SKU's pause act on one sale in turn, and the
/// stock and audit rows checked at the end are what those steps left.
#[tokio::test]
async fn a_pause_reaches_buyers_until_resumed() {
    let env = TestEnv::with_topics().await;
    env.activity_skus(1200, &[(1, 10), (2, 10)]).await;
    let apis = start_with_admin(&env).await;
    let post = reqwest::Method::POST;
    let pause_url = format!("{}/admin/v1/sales/1200/pause", apis.admin);
    let resume_url = format!("{}/admin/v1/sales/1200/resume", apis.admin);
    let status_url = format!("{}/admin/v1/sales/1200", apis.admin);

    let (s, _) = reserve(&apis.base, 1200, 1, 1).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    // Pause the activity: every buyer gets SALE_PAUSED with the reason, nothing reserved.
    let (s, b) = admin_call(
        post.clone(),
        pause_url.clone(),
        Some(ADMIN_TOKEN),
        Some(json!({"reason": "inventory recount"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, b) = reserve(&apis.base, 1200, 1, 2).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("SALE_PAUSED"))
    );
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("inventory recount"),
        "{b}"
    );
    let (s, st) = admin_call(
        reqwest::Method::GET,
        status_url.clone(),
        Some(ADMIN_TOKEN),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["paused"], "inventory recount");
    assert_eq!(st["skus"][0]["remaining"], 9);
    // Resume: buyers are served again.
    let (s, _) = admin_call(post.clone(), resume_url.clone(), Some(ADMIN_TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = reserve(&apis.base, 1200, 1, 2).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    // One SKU only: the other keeps selling.
    let (s, _) = admin_call(
        post.clone(),
        pause_url.clone(),
        Some(ADMIN_TOKEN),
        Some(json!({"reason": "price error", "sku_id": 2})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = reserve(&apis.base, 1200, 2, 3).await;
    assert_eq!(
        (s, b["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("SALE_PAUSED"))
    );
    let (s, _) = reserve(&apis.base, 1200, 1, 3).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    // Bad input is a 400 and an unknown activity a 404.
    let (s, _) = admin_call(
        post.clone(),
        pause_url.clone(),
        Some(ADMIN_TOKEN),
        Some(json!({"reason": ""})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = admin_call(
        post.clone(),
        format!("{}/admin/v1/sales/999999/pause", apis.admin),
        Some(ADMIN_TOKEN),
        Some(json!({"reason": "x"})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Every action left its audit row, the token itself never.
    let actions = env.count("SELECT count(*) FROM admin_audit WHERE action IN ('pause', 'resume') AND actor LIKE 'admin-api@127.0.0.1:%'").await;
    assert_eq!(
        actions, 4,
        "pause, resume, pause of a SKU, and the refused pause of an unknown activity"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM admin_audit WHERE detail::text LIKE '%{ADMIN_TOKEN}%'"
        ))
        .await,
        0
    );
    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(1200, 1).await.unwrap(),
        Some((10, 7))
    );
    assert_eq!(
        redis.stock().sku_stock(1200, 2).await.unwrap(),
        Some((10, 10))
    );
    apis.stop.cancel();
    env.cleanup().await;
}

/// The real publisher, or a broker that does not answer while `down`.
struct Switchable {
    real: Arc<dyn Publisher>,
    down: AtomicBool,
}

#[async_trait::async_trait]
impl Publisher for Switchable {
    async fn send(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome {
        if self.down.load(Ordering::SeqCst) {
            return SendOutcome::Unknown {
                error: "send timed out (the broker does not answer)".into(),
            };
        }
        self.real.send(msg, timeout_ms).await
    }
    async fn send_batch(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome> {
        if self.down.load(Ordering::SeqCst) {
            return msgs
                .iter()
                .map(|_| SendOutcome::Unknown {
                    error: "send timed out (the broker does not answer)".into(),
                })
                .collect();
        }
        self.real.send_batch(msgs, timeout_ms).await
    }
}

#[tokio::test]
async fn dead_outbox_rows_come_back_by_themselves_once_the_broker_answers() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.relay_max_attempts = 1;
    // Every row due at once, timers included (they are otherwise held until shortly before
    // their deadline: tests/it/outbox_timers.rs).
    env.settings.scan.timer_lead_secs = 86_400;
    env.activity(1210, 1, 10).await;
    created_orders(&env, 1210, &[1, 2]).await;
    let rows = env.count("SELECT count(*) FROM event_outbox").await;
    assert!(rows >= 2, "{rows}");
    let publisher = Arc::new(Switchable {
        real: seckill::mq::connect_publisher(&env.settings).await.unwrap(),
        down: AtomicBool::new(true),
    });
    let relay = Relay::new(
        env.pool(2).await,
        publisher.clone(),
        Arc::new(env.settings.clone()),
    );
    // The broker does not answer: after the last attempt every row is DEAD, for want of a broker.
    relay.relay_once().await.unwrap();
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE status = 'DEAD' AND dead_reason = 'BROKER'"
        )
        .await,
        rows
    );
    // Still down: the idle probe brings one row back, it dies again, nothing is lost.
    assert!(relay.probe_dead().await.unwrap());
    relay.relay_once().await.unwrap();
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'DEAD'")
            .await,
        rows
    );
    // The broker answers again: the probe's row is confirmed, and that brings the others back.
    publisher.down.store(false, Ordering::SeqCst);
    assert!(relay.probe_dead().await.unwrap());
    for _ in 0..4 {
        relay.relay_once().await.unwrap();
    }
    // Delayed rows (CANCEL_IF_UNPAID) are sent with their deliver time; all are SENT now.
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'SENT'")
            .await,
        rows
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE auto_requeues >= 1")
            .await,
        rows
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_operator_requeues_refused_rows_with_the_cli_and_an_audit_row() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    c.execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, dead_reason)
         VALUES ('evt-refused', 'T', 'ORDER_PAID', 'ord_x', '{}', 'DEAD', 'REFUSED'),
                ('evt-other', 'T', 'ORDER_PAID', 'ord_y', '{}', 'DEAD', 'REFUSED')",
        &[],
    )
    .await
    .unwrap();
    let out = common::cli(&env, &["outbox", "requeue", "--event-id", "evt-refused"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "evt-refused");
    assert_eq!(env.count("SELECT count(*) FROM event_outbox WHERE status = 'PENDING' AND attempts = 0 AND event_id = 'evt-refused'").await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE status = 'DEAD'")
            .await,
        1
    );
    assert_eq!(env.count("SELECT count(*) FROM admin_audit WHERE action = 'outbox_requeue' AND actor LIKE 'cli:%' AND detail->'requeued' ? 'evt-refused'").await, 1);
    drop(c);
    env.cleanup().await;
}

#[tokio::test]
async fn an_unreadable_lag_closes_admission_once_reservations_went_out() {
    let mut env = TestEnv::with_topics().await;
    env.settings.api.admission_check_ms = 50;
    env.settings.api.lag_unreadable_probes = 3;
    env.activity(1220, 1, 10).await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let mut state = seckill::roles::api::build_state(Arc::new(env.settings.clone()), publisher)
        .await
        .unwrap();
    // A probe that cannot read the lag (its topic has no route: the broker answers nothing it
    // could read), while the reservations go to the real order topic.
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    state.lag = Some(seckill::mq::lag::LagSource {
        probe: Arc::new(probe),
        group: env.names().order_create_group,
        topic: format!("NO_ROUTE_{}", env.id.to_uppercase()),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(seckill::roles::api::serve(listener, state, stop.clone()));
    common::wait_ready(format!("{base}/readyz")).await;
    // Nothing sent yet: an unreadable lag alone does not close the sale.
    let (s, b) = reserve(&base, 1220, 1, 1).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    // One reservation went out and nobody can say it is consumed: admission closes.
    let mut user = 2;
    eventually(15, "admission closed on an unreadable lag", || {
        user += 1;
        let base = base.clone();
        let u = user;
        async move {
            let (s, b) = reserve(&base, 1220, 1, u).await;
            s == StatusCode::SERVICE_UNAVAILABLE
                && b["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("lag cannot be read"))
        }
    })
    .await;
    // The buyers' port serves no metrics; this process's registry is read directly.
    let metrics = seckill::telemetry::metrics_handle().render();
    assert!(
        metrics.contains("admission_lag_unreadable_total"),
        "the probe failures are counted"
    );
    stop.cancel();
    env.cleanup().await;
}
