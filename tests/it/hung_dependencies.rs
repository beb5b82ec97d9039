//! A hung dependency cannot hang the API (docs/architecture/hot-path.md#hung-dependencies): with
//! Redis behind a proxy that stops forwarding, a reservation fails with 503 within its bounds and
//! `/readyz` answers 503 within a second; with PostgreSQL behind one, its routes (orders, payments)
//! answer 503 within theirs while reservations go on. Once the dependency answers again everything
//! recovers, and a request that failed, retried, lands exactly once.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{eventually, start_api, StallProxy, TestEnv};
use serde_json::{json, Value};

#[tokio::test]
async fn a_hung_redis_gets_503_within_bounds_and_the_api_recovers_after() {
    let env = TestEnv::with_topics().await;
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
    assert_eq!(redis.stock().sku_stock(980, 1).await.unwrap(), Some((5, 4)));

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}

/// The test's settings with PostgreSQL behind a proxy that can stop forwarding, and a 1 s
/// statement timeout.
async fn postgresql_behind_a_proxy(env: &TestEnv) -> (StallProxy, seckill::config::Settings) {
    let proxy = StallProxy::start("127.0.0.1:5432").await;
    let mut settings = env.settings.clone();
    settings.pg.url = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.addr.port()
    )
    .into();
    settings.pg.statement_timeout_ms = 1000;
    (proxy, settings)
}

#[tokio::test]
async fn a_hung_postgresql_gets_503_within_bounds_and_reservations_go_on() {
    let env = TestEnv::with_topics().await;
    env.activity(985, 1, 5).await;
    let order = common::created_orders(&env, 985, &[9])
        .await
        .remove(0)
        .order_id;
    let (proxy, mut settings) = postgresql_behind_a_proxy(&env).await;
    settings.pg.pool_wait_timeout_ms = 500;
    let api = start_api(settings).await;
    let base = api.base.clone();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let get_order = || {
        client
            .get(format!("{base}/v1/orders/{order}"))
            .header("authorization", common::bearer(9))
            .send()
    };
    assert_eq!(get_order().await.unwrap().status().as_u16(), 200);

    proxy.stall(true);
    // The order store hangs: its routes answer 503 within the bound (statement timeout + 1 s).
    let started = Instant::now();
    let r = get_order().await.unwrap();
    let took = started.elapsed();
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "UNAVAILABLE", "{body}");
    assert!(took < Duration::from_secs(3), "answered in {took:?}");
    let started = Instant::now();
    let (s, body) = common::notify_payment(&base, &order, "pay-hung", 100).await;
    assert_eq!(
        (s.as_u16(), body["error"]["code"].as_str()),
        (503, Some("UNAVAILABLE"))
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The hot path does not touch PostgreSQL: reservations go on, and the API stays ready.
    let r = client
        .post(format!("{base}/v1/activities/985/skus/1/reservations"))
        .header("authorization", common::bearer(10))
        .json(&json!({"request_id": "during-pg-hang", "quantity": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let r = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);

    proxy.stall(false);
    // Connections cut mid-request are dropped by the pool; fresh ones answer.
    eventually(30, "the order store answers again", || async {
        matches!(get_order().await, Ok(r) if r.status().is_success())
    })
    .await;
    // The payment the provider re-sends lands exactly once, whatever the hung attempt did.
    let (s, body) = common::notify_payment(&base, &order, "pay-hung", 100).await;
    assert_eq!(s.as_u16(), 200, "{body}");
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'")
            .await,
        1
    );
    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_order_transaction_on_a_hung_postgresql_gives_up_within_its_bound() {
    let env = TestEnv::without_topics().await;
    env.activity(986, 1, 5).await;
    let (proxy, mut settings) = postgresql_behind_a_proxy(&env).await;
    settings.consumer.tx_timeout_ms = 1500;
    let pool = seckill::pg::connect_pool(&settings.pg, 1).await.unwrap();
    let handler =
        seckill::roles::consume::order_create::OrderCreateHandler::new(pool, &settings, 1);
    let names = settings.names();
    let event = common::event(986, 1, 9, 300);
    let delivery = common::delivery_of(&names.order_create_topic, &event);

    proxy.stall(true);
    let started = Instant::now();
    let r = handler.process(std::slice::from_ref(&delivery)).await;
    let took = started.elapsed();
    assert!(
        matches!(r, Err(seckill::pg::errors::TxError::Transient(_))),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(3), "gave up after {took:?}");

    proxy.stall(false);
    // The same message again (as the broker redelivers it): one order, whatever the cut-off
    // attempt did.
    eventually(30, "the order transaction commits", || async {
        handler
            .process(std::slice::from_ref(&delivery))
            .await
            .is_ok()
    })
    .await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    env.cleanup().await;
}
