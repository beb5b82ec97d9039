//! The order transaction and the stock: a batch larger than the stock left, a batch over
//! several SKUs, many buyers at once on one hot SKU (never a deadlock, never an oversell), calls
//! far past the transaction budget gathered (docs/architecture/order-creation.md#worker-budget),
//! and stock buckets (one transaction per bucket, a unit taken from another bucket when the home
//! one is empty).

use std::sync::Arc;

use super::handler;
use crate::common::{delivery_of, event, TestEnv};
use seckill::domain::{Decision, RejectReason};
use seckill::mq::{BatchHandler, ConsumeDecision};
use seckill::roles::consume::order_create::OrderCreateHandler;

#[tokio::test]
async fn a_batch_larger_than_the_stock_left_gets_what_is_left_and_rejects_the_rest() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 3).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let events: Vec<_> = (1..=5).map(|u| event(1, 1, u, 300)).collect();
    let batch: Vec<_> = events.iter().map(|e| delivery_of(&topic, e)).collect();
    let decisions = h.process(&batch).await.unwrap();
    let created = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Created { .. }))
        .count();
    let no_stock = decisions
        .iter()
        .filter(|d| **d == Decision::Rejected(RejectReason::NoStock))
        .count();
    assert_eq!((created, no_stock), (3, 2), "{decisions:?}");
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    assert_eq!(
        env.count("SELECT coalesce(sum(delta),0)::int8 FROM stock_ledger")
            .await,
        -3
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'NO_STOCK'")
            .await,
        2
    );
    // One commit stamp for the transaction, naming its 3 orders, taken after every order
    // row was written (at the end of the transaction, after the stock decrement).
    assert_eq!(
        env.count(
            "SELECT count(*) FROM orders o JOIN order_commits c USING (xact_id)
             WHERE c.orders = 3 AND c.committed_at >= o.created_at"
        )
        .await,
        3
    );
    assert_eq!(env.count("SELECT count(*) FROM order_commits").await, 1);
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_over_several_skus_takes_each_skus_stock_once() {
    let env = TestEnv::without_topics().await;
    env.activity_skus(1, &[(1, 5), (2, 5)]).await;
    let h = handler(&env, 1).await;
    let topic = env.names().order_create_topic;
    let created = |d: &[Decision]| {
        d.iter()
            .filter(|d| matches!(d, Decision::Created { .. }))
            .count()
    };
    let stock = |sku: i64| {
        let env = &env;
        async move {
            env.count(&format!(
                "SELECT remaining_stock::int8 FROM sku_stock WHERE sku_id = {sku}"
            ))
            .await
        }
    };
    // Enough of both: every order is created (the optimistic path, one decrement per SKU).
    let first: Vec<_> = [(1, 1), (1, 2), (1, 3), (2, 4), (2, 5)]
        .into_iter()
        .map(|(sku, user)| delivery_of(&topic, &event(1, sku, user, 300)))
        .collect();
    let d = h.process(&first).await.unwrap();
    assert_eq!(created(&d), 5, "{d:?}");
    assert_eq!((stock(1).await, stock(2).await), (2, 3));
    // SKU 1 still has enough, SKU 2 does not: SKU 1 gets all it asked for, SKU 2 what is left.
    let second: Vec<_> = [(1, 6), (1, 7), (2, 8), (2, 9), (2, 10), (2, 11)]
        .into_iter()
        .map(|(sku, user)| delivery_of(&topic, &event(1, sku, user, 300)))
        .collect();
    let d = h.process(&second).await.unwrap();
    let no_stock = d
        .iter()
        .filter(|d| **d == Decision::Rejected(RejectReason::NoStock))
        .count();
    assert_eq!((created(&d), no_stock), (5, 1), "{d:?}");
    assert_eq!((stock(1).await, stock(2).await), (0, 0));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 10);
    assert_eq!(
        env.count("SELECT coalesce(sum(delta),0)::int8 FROM stock_ledger")
            .await,
        -10
    );
    env.cleanup().await;
}

#[tokio::test]
async fn many_buyers_at_once_never_deadlock_and_never_oversell() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 30).await;
    let h = handler(&env, 8).await;
    let topic = env.names().order_create_topic;
    let calls = (1..=60).map(|user| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, user, 300));
        async move { h.process(&[d]).await }
    });
    let results = futures::future::join_all(calls).await;
    // Concurrent transactions on one hot SKU must serialise on its row, not fail.
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(failures.is_empty(), "transactions failed: {failures:?}");
    let created = results
        .iter()
        .flatten()
        .filter(|d| matches!(d[0], Decision::Created { .. }))
        .count();
    assert_eq!(created, 30);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 30);
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks WHERE reason = 'NO_STOCK'")
            .await,
        30
    );
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    env.cleanup().await;
}

#[tokio::test]
async fn calls_far_past_the_budget_are_gathered_and_never_run_more_transactions_than_the_budget() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 200).await;
    // A pool much larger than the budget: only the limiter can hold the line.
    let h = Arc::new(OrderCreateHandler::new(
        env.pool(20).await,
        &env.settings,
        2,
    ));
    let topic = env.names().order_create_topic;
    // 64 batches at once, as `consume --workers 64` would hand over.
    let calls = (1..=64).map(|user| {
        let h = h.clone();
        let d = delivery_of(&topic, &event(1, 1, user, 300));
        async move { h.handle(vec![d]).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 64);
    let limiter = h.limiter();
    assert!(
        limiter.high_water() <= 2,
        "transactions at once: {}",
        limiter.high_water()
    );
    assert!(limiter.high_water() >= 1 && limiter.limit() <= 2);
    // The 64 one-message calls were gathered: a few full transactions, not one commit per
    // order (docs/architecture/order-creation.md#gathering-batches-across-queues).
    let transactions = env
        .count("SELECT count(DISTINCT xact_id) FROM orders")
        .await;
    assert!(
        (2..=4).contains(&transactions),
        "64 calls of one message took {transactions} transactions"
    );
    env.cleanup().await;
}

/// Runs 8 calls of 4 messages at once, each call carrying one order of each of 4 stock
/// buckets, through a handler with a budget of 2; returns the transactions that committed
/// orders of more than one bucket, and the transactions in all.
async fn calls_over_four_buckets(env: &TestEnv, activity_id: i64, lanes: bool) -> (i64, i64) {
    env.activity_in_buckets(activity_id, &[(1, 200)], 4).await;
    let mut settings = env.settings.clone();
    settings.consumer.bucket_lanes = lanes;
    let h = Arc::new(OrderCreateHandler::new(env.pool(3).await, &settings, 2));
    let topic = env.names().order_create_topic;
    let calls = (0..8i64).map(|call| {
        let batch = (0..4u16)
            .map(|bucket| {
                let mut e = event(activity_id, 1, call * 4 + i64::from(bucket) + 1, 300);
                let ids = seckill::domain::ids::Ids::generate(activity_id, bucket);
                e.reservation_id = ids.reservation_id.clone();
                e.message_key = ids.reservation_id;
                delivery_of(&topic, &e)
            })
            .collect::<Vec<_>>();
        let h = h.clone();
        async move { h.handle(batch).await }
    });
    let decisions = futures::future::join_all(calls).await;
    assert!(decisions.iter().all(|d| *d == ConsumeDecision::Ack));
    let orders = format!("SELECT count(*) FROM orders WHERE activity_id = {activity_id}");
    assert_eq!(env.count(&orders).await, 32);
    // Each bucket's row gave exactly its 8 orders' units (50 each of 200).
    let rows = format!(
        "SELECT count(*) FROM stock_buckets WHERE activity_id = {activity_id} AND remaining_stock = 42"
    );
    assert_eq!(env.count(&rows).await, 4);
    let mixed = env
        .count(&format!(
            "SELECT count(*) FROM (SELECT xact_id FROM orders WHERE activity_id = {activity_id}
              GROUP BY xact_id HAVING count(DISTINCT stock_bucket) > 1) m"
        ))
        .await;
    let transactions = env
        .count(&format!(
            "SELECT count(DISTINCT xact_id) FROM orders WHERE activity_id = {activity_id}"
        ))
        .await;
    (mixed, transactions)
}

#[tokio::test]
async fn a_call_over_several_stock_buckets_becomes_one_transaction_per_bucket() {
    let env = TestEnv::without_topics().await;
    // Lanes on (the default): no transaction holds two buckets' orders, so no two lock the
    // same stock rows; still gathered (8 calls of 4 took far fewer than 32 transactions).
    let (mixed, transactions) = calls_over_four_buckets(&env, 1, true).await;
    assert_eq!(mixed, 0, "transactions over several buckets");
    assert!(
        (4..=16).contains(&transactions),
        "32 orders of 4 buckets took {transactions} transactions"
    );
    // Off: every call's transaction carries all four buckets' orders.
    let (mixed, transactions) = calls_over_four_buckets(&env, 2, false).await;
    assert_eq!(
        mixed, transactions,
        "with lanes off every transaction mixes buckets"
    );
    env.cleanup().await;
}

/// An order whose home bucket's row has no unit left takes one from another bucket of its SKU
/// (the locked path): the order and its ledger debit name the bucket that gave it, and that
/// row is the one decremented.
#[tokio::test]
async fn an_order_whose_home_bucket_is_empty_takes_its_unit_from_another_bucket() {
    let env = TestEnv::without_topics().await;
    let activity_id = 3;
    env.activity_in_buckets(activity_id, &[(1, 8)], 4).await;
    let pool = env.pool(2).await;
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE stock_buckets SET remaining_stock = 0 WHERE activity_id = $1 AND bucket = 0",
            &[&activity_id],
        )
        .await
        .unwrap();
    let h = OrderCreateHandler::new(pool, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let batch = (1..=3i64)
        .map(|user| {
            let mut e = event(activity_id, 1, user, 300);
            let ids = seckill::domain::ids::Ids::generate(activity_id, 0);
            e.reservation_id = ids.reservation_id.clone();
            e.message_key = ids.reservation_id;
            delivery_of(&topic, &e)
        })
        .collect::<Vec<_>>();
    assert_eq!(h.handle(batch).await, ConsumeDecision::Ack);
    let a = activity_id;
    let q = |sql: String| {
        let env = &env;
        async move { env.count(&sql).await }
    };
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM orders WHERE activity_id = {a} AND stock_bucket <> 0"
        ))
        .await,
        3,
        "every order names the bucket that gave its unit"
    );
    assert_eq!(
        q(format!(
            "SELECT count(*) FROM orders o JOIN stock_ledger l USING (order_id)
             WHERE o.activity_id = {a} AND l.bucket = o.stock_bucket AND l.delta = -1"
        ))
        .await,
        3,
        "each ledger debit is from the order's bucket"
    );
    assert_eq!(
        q(format!(
            "SELECT sum(total_stock - remaining_stock)::int8 FROM stock_buckets
             WHERE activity_id = {a} AND bucket <> 0"
        ))
        .await,
        3
    );
    env.cleanup().await;
}
