//! The order consumer's connections reuse plans
//! (docs/architecture/order-creation.md#planning-once): that is safe only while the statements
//! every batch sends never search the tables a sale grows by thousands of rows a second, so no
//! generic plan made on an empty table can misjudge them. This drives the real handler on
//! connections forced to generic plans from their first run, on a schema never analyzed, and counts
//! the rows PostgreSQL read from those tables.

use crate::common::{create_orders, delivery_of, event, eventually, TestEnv};
use seckill::domain::{Decision, RejectReason};
use seckill::roles::consume::order_create::OrderCreateHandler;

/// Rows read (sequentially or through an index) from the inbox, reservations and orders, and
/// the inbox rows inserted, as the statistics collector has them.
async fn reads_and_claims(env: &TestEnv) -> (i64, i64) {
    let reads = env
        .count(
            "SELECT ((SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
                     WHERE schemaname = current_schema() AND relname IN ({GROWING}))
                  + (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
                     WHERE schemaname = current_schema() AND relname IN ({GROWING})))::int8"
                .replace("{GROWING}", "'consumer_inbox', 'reservations', 'orders'")
                .as_str(),
        )
        .await;
    let claims = env
        .count(
            "SELECT n_tup_ins FROM pg_stat_user_tables
             WHERE schemaname = current_schema() AND relname = 'consumer_inbox'",
        )
        .await;
    (reads, claims)
}

#[tokio::test]
async fn batches_of_created_orders_read_no_row_of_the_growing_tables_whatever_the_plans() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 10_000).await;
    let pool = env.order_pool(2).await;
    // Both connections plan generically from the first run: the worst a cached plan can be.
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    for c in [&a, &b] {
        c.batch_execute("SET plan_cache_mode = force_generic_plan")
            .await
            .unwrap();
    }
    drop((a, b));
    let h = OrderCreateHandler::new(pool, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let (reads_before, claims_before) = reads_and_claims(&env).await;
    const BATCHES: i64 = 20;
    for batch in 0..BATCHES {
        let events: Vec<_> = (0..32)
            .map(|i| event(1, 1, batch * 100 + i + 1, 300))
            .collect();
        create_orders(&h, &topic, &events).await;
    }
    // The handler's backends report their counters when idle (within seconds): wait until
    // every claim is counted, so the reads counted beside them are the batches' too.
    let want = claims_before + BATCHES * 32;
    eventually(30, "the batches' statistics reported", || async {
        reads_and_claims(&env).await.1 >= want
    })
    .await;
    let (reads_after, _) = reads_and_claims(&env).await;
    assert_eq!(
        reads_after - reads_before,
        0,
        "the order transaction's every-batch statements searched the inbox, reservations or \
         orders: a generic plan made on an empty table would read more of them each batch"
    );

    // The exceptions are corrected with plans made for their ids, on the same connections:
    // a second message for a buyer who has an order, and an expired reservation.
    let again = event(1, 1, 5, 300);
    let expired = event(1, 1, 9_999, -1);
    let decisions = h
        .process(&[delivery_of(&topic, &again), delivery_of(&topic, &expired)])
        .await
        .unwrap();
    assert_eq!(
        decisions,
        vec![
            Decision::Rejected(RejectReason::DuplicateBuyer),
            Decision::Rejected(RejectReason::Expired)
        ]
    );
    let inbox = |id: &str| {
        format!(
            "SELECT count(*) FROM consumer_inbox WHERE message_id = '{id}'
               AND status = 'REJECTED' AND decision = '{}'",
            if id == again.message_id {
                "DUPLICATE_BUYER"
            } else {
                "EXPIRED"
            }
        )
    };
    assert_eq!(env.count(&inbox(&again.message_id)).await, 1);
    assert_eq!(env.count(&inbox(&expired.message_id)).await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM consumer_inbox WHERE status <> 'SUCCEEDED' OR decision <> 'CREATED'")
            .await,
        2
    );
    env.cleanup().await;
}
