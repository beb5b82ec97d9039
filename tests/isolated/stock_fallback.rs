//! The order transaction's savepoint fallback, reached on purpose: the optimistic path reads
//! enough stock, another transaction takes most of it before the decrement, the conditional
//! decrement misses, everything written since the savepoint is rolled back and the locked path
//! grants what is left. Its own test binary: the failpoint callback is process-wide.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{delivery_of, event, TestEnv};
use seckill::mq::{BatchHandler, ConsumeDecision};
use seckill::roles::consume::order_create::OrderCreateHandler;
use secrecy::ExposeSecret;

/// Stock taken by another writer between the transaction's read and its decrement sends the batch
/// to the locked path: it grants what is left, rejects the rest, and nothing of the first attempt
/// survives.
///
/// One story: one batch meets one injected write, and every count after it reads what that batch
/// committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_taken_between_the_read_and_the_decrement_falls_back_to_the_locked_path() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 5).await;
    let handler = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let topic = env.settings.names().order_create_topic.clone();

    // Another writer leaves 2 units after the transaction read 5. The row is only share-locked
    // by the orders' foreign keys at that point, so this update does not wait.
    let hits = Arc::new(AtomicUsize::new(0));
    let (url, schema, seen) = (
        env.settings.pg.url.expose_secret().to_string(),
        env.settings.pg.schema.clone(),
        hits.clone(),
    );
    let _only_failpoints = crate::common::process_failpoints().await;
    fail::cfg_callback("order-tx-after-stock-peek", move || {
        seen.fetch_add(1, Ordering::SeqCst);
        let out = std::process::Command::new("psql")
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &url, "-c"])
            .arg(format!(
                "UPDATE {schema}.stock_buckets SET remaining_stock = 2 WHERE activity_id = 1 AND sku_id = 1"
            ))
            .output()
            .expect("psql runs");
        assert!(out.status.success(), "{out:?}");
    })
    .unwrap();

    let deliveries: Vec<_> = (1..=4)
        .map(|user| delivery_of(&topic, &event(1, 1, user, 300)))
        .collect();
    assert_eq!(handler.handle(deliveries).await, ConsumeDecision::Ack);
    fail::remove("order-tx-after-stock-peek");

    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the optimistic path ran once"
    );
    // The locked path granted the 2 units left and rejected the other 2: nothing of the
    // optimistic attempt (4 created orders) survived the rollback to the savepoint.
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 2);
    assert_eq!(
        env.count("SELECT remaining_stock::int8 FROM sku_stock")
            .await,
        0
    );
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 2);
    assert_eq!(
        env.count("SELECT count(*) FROM reservations WHERE status = 'REJECTED' AND reject_reason = 'NO_STOCK'")
            .await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM compensation_tasks").await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_CREATED'")
            .await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM consumer_inbox WHERE status = 'SUCCEEDED'")
            .await,
        2
    );
    assert_eq!(
        env.count("SELECT count(*) FROM consumer_inbox WHERE status = 'REJECTED' AND decision = 'NO_STOCK'")
            .await,
        2
    );
    // The optimistic attempt's commit stamp went with the savepoint; the locked path wrote
    // the one stamp of the transaction, naming the 2 orders it kept.
    assert_eq!(
        env.count("SELECT count(*) FROM order_commits WHERE orders = 2")
            .await,
        1
    );
    assert_eq!(env.count("SELECT count(*) FROM order_commits").await, 1);
    env.cleanup().await;
}
