//! Abuse limits (docs/architecture/hot-path.md#abuse-limits): one buyer hammering the reservation
//! route gets 429 RATE_LIMITED with Retry-After while other buyers keep getting 202; an address's
//! bucket is its own, and `X-Forwarded-For` counts only from a trusted proxy.

use crate::common;

use crate::common::{start_api, TestEnv};
use serde_json::json;

/// One reservation request: (status, Retry-After, error code).
async fn reserve(
    client: &reqwest::Client,
    url: &str,
    user: i64,
    request_id: &str,
    forwarded_for: Option<&str>,
) -> (u16, Option<String>, String) {
    let mut req = client
        .post(url)
        .header("authorization", common::bearer(user))
        .json(&json!({"user_id": user, "request_id": request_id, "quantity": 1}));
    if let Some(f) = forwarded_for {
        req = req.header("x-forwarded-for", f);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let body: serde_json::Value = r.json().await.unwrap_or_default();
    let code = body["error"]["code"].as_str().unwrap_or("").to_string();
    (status, retry, code)
}

#[tokio::test]
async fn a_hammering_buyer_gets_429_while_other_buyers_get_202() {
    let env = TestEnv::with_topics().await;
    env.activity(985, 1, 100).await;
    let mut settings = env.settings.clone();
    // One token every 10 s: no token comes back while the test runs, however slow the machine.
    settings.api.buyer_rate_per_sec = 0.1;
    settings.api.buyer_burst = 3;
    let api = start_api(settings).await;
    let (base, stop) = (api.base, api.stop);
    let url = format!("{base}/v1/activities/985/skus/1/reservations");
    let client = reqwest::Client::new();

    let mut limited = 0;
    for i in 0..20 {
        let (status, retry, code) = reserve(&client, &url, 1, &format!("hammer-{i}"), None).await;
        match status {
            429 => {
                limited += 1;
                assert_eq!(code, "RATE_LIMITED");
                let secs: u64 = retry.expect("Retry-After").parse().unwrap();
                assert!((1..=10).contains(&secs), "{secs}");
            }
            202 | 409 => assert!(
                i < 3,
                "request {i} passed an empty bucket ({status} {code})"
            ),
            other => panic!("request {i}: {other} {code}"),
        }
    }
    assert_eq!(
        limited, 17,
        "the burst of 3 passed, every later request was refused"
    );
    for user in 2..=10 {
        let (status, _, code) = reserve(&client, &url, user, "once", None).await;
        assert_eq!(status, 202, "buyer {user}: {code}");
    }
    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(985, 1).await.unwrap(),
        Some((100, 90)),
        "one unit for the hammering buyer, one each for the nine others"
    );
    stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn an_address_has_its_own_bucket_and_forwarded_addresses_count_only_from_a_trusted_proxy() {
    let env = TestEnv::with_topics().await;
    env.activity(986, 1, 100).await;
    let mut settings = env.settings.clone();
    settings.api.address_rate_per_sec = 0.1;
    settings.api.address_burst = 2;
    let client = reqwest::Client::new();

    // Behind a trusted proxy (the test itself, on loopback): each forwarded address has its
    // own bucket.
    let mut trusting = settings.clone();
    trusting.api.trusted_proxies = vec!["127.0.0.1".parse().unwrap()];
    let api = start_api(trusting).await;
    let (base, stop) = (api.base, api.stop);
    let url = format!("{base}/v1/activities/986/skus/1/reservations");
    let mut seen = Vec::new();
    for user in 1..=4 {
        seen.push(
            reserve(&client, &url, user, "a", Some("198.51.100.7"))
                .await
                .0,
        );
    }
    assert_eq!(seen, vec![202, 202, 429, 429], "the first address's bucket");
    let (status, _, code) = reserve(&client, &url, 5, "b", Some("198.51.100.8")).await;
    assert_eq!(status, 202, "another address, another bucket: {code}");
    stop.cancel();

    // No trusted proxy: whatever a client forwards, its address is its own.
    let api = start_api(settings).await;
    let (base, stop) = (api.base, api.stop);
    let url = format!("{base}/v1/activities/986/skus/1/reservations");
    let mut seen = Vec::new();
    for (user, forged) in [
        (11, "203.0.113.1"),
        (12, "203.0.113.2"),
        (13, "203.0.113.3"),
    ] {
        seen.push(reserve(&client, &url, user, "c", Some(forged)).await.0);
    }
    assert_eq!(
        seen,
        vec![202, 202, 429],
        "one bucket for 127.0.0.1, forged addresses ignored"
    );
    stop.cancel();
    env.cleanup().await;
}
