//! A purchase through the API (docs/architecture/hot-path.md#the-hot-path): every 202 is
//! recorded MQ_SENT and found by id before its order exists, a reservation becomes one created
//! order visible through the API and is paid once, a request id reused on another SKU is
//! refused, and repeats, second purchases and sell-out are answered and never oversold.

use crate::common;

use super::{get_as, start};
use crate::common::{eventually, reserve_as as reserve, TestEnv};
use reqwest::StatusCode;
use serde_json::json;

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
    assert_eq!(redis.recovery().pending_count(120).await.unwrap(), 0);
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
    assert_eq!(redis.recovery().pending_count(100).await.unwrap(), 0);
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
        redis.stock().sku_stock(210, 2).await.unwrap(),
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
