//! A hung dependency cannot hang the API (docs/ARCHITECTURE.md#hung-dependencies): with Redis
//! behind a proxy that stops forwarding, a reservation fails with 503 within its bounds and
//! `/readyz` answers 503 within a second; once Redis answers again, everything recovers and
//! the request that failed, retried with the same request_id, is answered as usual.
// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

use std::time::{Duration, Instant};

use common::{eventually, start_api, StallProxy, TestEnv};
use serde_json::{json, Value};

#[tokio::test]
async fn a_hung_redis_gets_503_within_bounds_and_the_api_recovers_after() {
    let env = TestEnv::new(true).await;
    env.activity(980, 1, 5).await;
    let proxy = StallProxy::start("127.0.0.1:6379").await;
    let mut settings = env.settings.clone();
    settings.redis.url = format!("redis://{}", proxy.addr).into();
    settings.redis.response_timeout_ms = 500;
    settings.redis.pool_wait_timeout_ms = 500;
    let api = start_api(settings).await;
    let base = api.base.clone();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let reserve = |request_id: &'static str| {
        client
            .post(format!("{base}/v1/activities/980/skus/1/reservations"))
            .header("authorization", common::bearer(9))
            .json(&json!({"user_id": 9, "request_id": request_id, "quantity": 1}))
            .send()
    };

    proxy.stall(true);
    let started = Instant::now();
    let r = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "/readyz answered in {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let r = reserve("while-hung").await.unwrap();
    let took = started.elapsed();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "UNAVAILABLE", "{body}");
    assert!(took < Duration::from_secs(3), "answered in {took:?}");

    proxy.stall(false);
    eventually(15, "ready again", || async {
        matches!(client.get(format!("{base}/readyz")).send().await,
                 Ok(r) if r.status().is_success())
    })
    .await;
    // The request that failed, retried as its answer told: one reservation, whether or not
    // the script ran while Redis hung.
    let r = reserve("while-hung").await.unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let r = reserve("while-hung").await.unwrap();
    let again: Value = r.json().await.unwrap();
    assert_eq!(again["duplicate"], true, "{again}");
    let redis = env.redis().await;
    assert_eq!(redis.sku_stock(980, 1).await.unwrap(), Some((5, 4)));

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}
