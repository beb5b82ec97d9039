//! Bad input: malformed, oversized or mistyped reservation bodies and bad ids in paths get a
//! 400 JSON error (an unknown route a 404) and write nothing, with a publisher that must never
//! be reached.

use crate::common;

use std::sync::Arc;

use super::{get, start};
use crate::common::TestEnv;
use reqwest::StatusCode;
use seckill::mq::{OutMessage, Publisher};
use serde_json::{json, Value};

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

/// Activity 300 with 5 units, and an API whose publisher must never be reached (nothing bad
/// may get that far).
async fn started() -> (TestEnv, super::Running) {
    let env = TestEnv::without_topics().await;
    env.activity(300, 1, 5).await;
    let publisher: Arc<dyn Publisher> = Arc::new(NeverCalled);
    let app = start(&env, publisher, false).await;
    (env, app)
}

/// Redis still holds activity 300's whole stock and no reservation.
async fn nothing_written(env: &TestEnv) {
    let redis = env.redis().await;
    assert_eq!(redis.stock().sku_stock(300, 1).await.unwrap(), Some((5, 5)));
    assert_eq!(
        redis
            .stock()
            .reservation_census(300, 1)
            .await
            .unwrap()
            .by_status
            .len(),
        0
    );
}

/// Malformed, oversized or mistyped reservation bodies: a 400 JSON error each, nothing written.
#[tokio::test]
async fn bad_bodies_get_a_400_json_error_and_write_nothing() {
    let (env, app) = started().await;
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
    nothing_written(&env).await;
    app.stop().await;
    env.cleanup().await;
}

/// Bad ids in paths, hostile headers and bad ids in reads: a 4xx JSON error each (an unknown
/// route a 404), never a 5xx, nothing written.
#[tokio::test]
async fn bad_paths_and_hostile_headers_get_a_4xx_json_error_and_write_nothing() {
    let (env, app) = started().await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/activities/300/skus/1/reservations", app.base);
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
    nothing_written(&env).await;
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
