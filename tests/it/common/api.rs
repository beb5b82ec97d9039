//! The API served in the test's process, and calls to it as a buyer, an operator or the
//! payment provider.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use seckill::config::Settings;

use super::*;

/// The API served in-process on a free loopback port, with the real broker publisher.
pub struct Api {
    pub addr: std::net::SocketAddr,
    /// `http://<addr>`.
    pub base: String,
    /// `http://<ops addr>`: its /metrics, /healthz, /readyz (`api.metrics_listen`).
    pub ops: String,
    pub ready: seckill::telemetry::Readiness,
    /// Cancel to stop it (it drains its requests first).
    pub stop: tokio_util::sync::CancellationToken,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts the API with `settings` and waits until `/readyz` answers 200.
pub async fn start_api(settings: Settings) -> Api {
    let publisher = seckill::mq::connect_publisher(&settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(settings), publisher)
        .await
        .expect("api state");
    let ready = state.ready.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ops = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ops_base = format!("http://{}", ops.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let listeners = seckill::roles::api::Listeners {
        buyers: listener,
        ops: Some(ops),
        admin: None,
    };
    let server = tokio::spawn(seckill::roles::api::serve_listeners(
        listeners,
        state,
        stop.clone(),
    ));
    let base = format!("http://{addr}");
    wait_ready(format!("{base}/readyz")).await;
    Api {
        addr,
        base,
        ops: ops_base,
        ready,
        stop,
        server,
    }
}

/// The API with its admin listener: the buyers' and the admin base URLs, and its stop.
pub struct AdminApi {
    pub base: String,
    pub admin: String,
    pub stop: tokio_util::sync::CancellationToken,
}

/// One call to an admin route, with `Authorization: Bearer <token>` when given and `body` as
/// JSON: the status and the JSON body (`Null` when there is none).
pub async fn admin_call(
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut req = reqwest::Client::new().request(method, url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// The stable code of a JSON error answer (`{"error": {"code": ...}}`).
pub fn error_code(body: &serde_json::Value) -> Option<&str> {
    body["error"]["code"].as_str()
}

/// Starts the API of `env` with an admin listener guarded by `token`.
pub async fn start_with_admin(env: &TestEnv, token: &str) -> AdminApi {
    let mut settings = env.settings.clone();
    settings.api.admin_token = secrecy::SecretString::from(token.to_string());
    let publisher = seckill::mq::connect_publisher(&settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(settings), publisher)
        .await
        .unwrap();
    let buyers = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", buyers.local_addr().unwrap());
    let admin_base = format!("http://{}", admin.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let listeners = seckill::roles::api::Listeners {
        buyers,
        ops: None,
        admin: Some(admin),
    };
    tokio::spawn(seckill::roles::api::serve_listeners(
        listeners,
        state,
        stop.clone(),
    ));
    wait_ready(format!("{base}/readyz")).await;
    AdminApi {
        base,
        admin: admin_base,
        stop,
    }
}

/// `POST /v1/activities/{activity}/skus/{sku}/reservations` as buyer `user` (its development
/// token), with `request_id`: the status and the JSON body.
pub async fn reserve_as(
    base: &str,
    activity: i64,
    sku: i64,
    user: i64,
    request_id: &str,
) -> (reqwest::StatusCode, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/{sku}/reservations"
        ))
        .header("authorization", bearer(user))
        .json(&serde_json::json!({"user_id": user, "request_id": request_id, "quantity": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// `Authorization` value of buyer `user`: a development token of the test configuration.
pub fn bearer(user: i64) -> String {
    let s = test_settings();
    let spec = seckill::auth::buyer::TokenSpec {
        user_id: user,
        ttl: Duration::from_secs(3600),
        audience: &s.auth.audience,
        issuer: &s.auth.issuer,
    };
    let token = seckill::auth::buyer::mint_dev(&s.auth.dev_hs256_secret, &spec).expect("mint");
    format!("Bearer {token}")
}

/// Posts a payment notification for `order_id` signed the way the provider signs it (with the
/// test configuration's first webhook secret, now).
pub async fn notify_payment(
    base: &str,
    order_id: &str,
    payment_id: &str,
    amount_cents: i64,
) -> (reqwest::StatusCode, serde_json::Value) {
    let body = serde_json::json!({
        "order_id": order_id, "payment_id": payment_id, "amount_cents": amount_cents,
    })
    .to_string();
    let secret = &test_settings().payments.webhook_secrets[0];
    let sig = seckill::auth::signature::sign(secret, Utc::now().timestamp(), body.as_bytes());
    post_notification(base, &body, Some(&sig)).await
}

/// Posts a payment notification body with this `Seckill-Signature` (or none).
pub async fn post_notification(
    base: &str,
    body: &str,
    signature: Option<&str>,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/payments/notifications"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(sig) = signature {
        req = req.header("seckill-signature", sig);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}
