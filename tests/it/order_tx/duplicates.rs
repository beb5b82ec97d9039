//! One order however often it is asked for: the same message 100 times at once, one
//! reservation under many message ids, one buyer's many reservations (the rest compensated):
//! invariants 2 and 3 of docs/architecture/invariants.md, kept by the inbox
//! (docs/architecture/order-creation.md#the-inbox) and the unique keys.

use super::handler;
use crate::common::{delivery_of, event, TestEnv};
use seckill::mq::{BatchHandler, ConsumeDecision};

#[tokio::test]
async fn same_message_delivered_100_times_concurrently_makes_one_order() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let e = event(1, 1, 42, 300);
    let d = delivery_of(&topic, &e);
    let calls = (0..100).map(|_| {
        let h = h.clone();
        let d = d.clone();
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(
        decisions.iter().all(|d| *d == ConsumeDecision::Ack),
        "{decisions:?}"
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM event_outbox").await, 2);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    let inv = seckill::invariants::check(
        &**env.pool(1).await.get().await.unwrap(),
        &env.redis().await,
        &env.names().order_create_group,
        1,
        1,
    )
    .await
    .unwrap();
    // Redis was warmed but never reserved (the message was injected), so only PG-side
    // invariants apply: no oversell, one order per buyer, one effect per message, ledger.
    assert!(
        inv.violations.iter().all(|v| v.contains("Redis")),
        "{:?}",
        inv.violations
    );
    env.cleanup().await;
}

#[tokio::test]
async fn one_reservation_under_many_message_ids_makes_one_order() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let base = event(1, 1, 11, 300);
    let calls = (0..20).map(|_| {
        let mut e = base.clone();
        e.message_id = seckill::domain::Ids::generate(1, 0).message_id;
        let h = h.clone();
        let d = delivery_of(&topic, &e);
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks").await,
        0
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    env.cleanup().await;
}

#[tokio::test]
async fn one_buyer_with_many_reservations_gets_one_order_and_the_rest_are_compensated() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let calls = (0..10).map(|_| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, 77, 300));
        async move { h.handle(vec![d]).await }
    });
    futures::future::join_all(calls).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE user_id = 77")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'DUPLICATE_BUYER'")
            .await,
        9
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        9
    );
    env.cleanup().await;
}
