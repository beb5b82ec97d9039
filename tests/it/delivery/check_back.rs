//! The check-back (`seckill::services::half_messages::PgChecker`) answers from PostgreSQL alone:
//! UNKNOWN while the local transaction may still commit, ROLLBACK once its deadline passed with
//! no row, a wait on the order's row lock that ends in COMMIT, UNKNOWN when the lock outlasts its
//! timeout, ROLLBACK for a row holding another attempt's payload.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{created_orders, eventually, TestEnv};
use seckill::domain::events::order_paid_event_id;
use seckill::mq::{Delivery, LocalOutcome, TransactionChecker};
use seckill::services::half_messages::{PgChecker, DEADLINE_PROPERTY};

/// A check-back's message: the event `event_id` of order `order_id`, due by `deadline_ms`,
/// with the payload `{"v": 1}`.
fn check_of(order_id: &str, event_id: &str, deadline_ms: i64) -> Delivery {
    Delivery {
        keys: order_id.to_string(),
        body: br#"{"v": 1}"#.to_vec(),
        properties: seckill::mq::Properties::from([
            ("message_id".to_string(), event_id.to_string()),
            (DEADLINE_PROPERTY.to_string(), deadline_ms.to_string()),
        ]),
        ..Default::default()
    }
}

/// The broker's check-back is answered from PostgreSQL alone: UNKNOWN or ROLLBACK with no row,
/// COMMIT after waiting for an uncommitted one, UNKNOWN under a lock held too long, ROLLBACK for
/// another payload.
///
/// One story: every check asks about the one order as the steps before left it, first with no row,
/// then with the row a local transaction commits.
#[tokio::test]
async fn the_check_back_answers_from_postgresql_alone() {
    let env = TestEnv::without_topics().await;
    env.activity(1403, 1, 5).await;
    let orders = created_orders(&env, 1403, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = order_paid_event_id(&oid, 2);
    let checker = PgChecker::new(env.pool(2).await, Duration::from_secs(3));
    let now_ms = chrono::Utc::now().timestamp_millis();
    let ahead = now_ms + 60_000;
    let past = now_ms - 1;

    // No row: UNKNOWN while the local transaction may still commit, ROLLBACK once it cannot.
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, ahead)).await,
        LocalOutcome::Unknown
    );
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Rollback
    );
    // A message without its deadline or event id cannot be decided.
    let mut bare = check_of(&oid, &event_id, past);
    bare.properties.remove(DEADLINE_PROPERTY);
    assert_eq!(checker.check(&bare).await, LocalOutcome::Unknown);

    // A local transaction that changed the order and wrote its row, not yet committed: a
    // check past the deadline waits for it instead of answering ROLLBACK, and answers COMMIT
    // once it commits.
    let pool = env.pool(1).await;
    let mut local = pool.get().await.unwrap();
    let tx = local.transaction().await.unwrap();
    tx.execute(
        "UPDATE orders SET status = 'PAID', version = 2, payment_id = 'pay-x', paid_at = now()
         WHERE order_id = $1",
        &[&oid],
    )
    .await
    .unwrap();
    tx.execute(
        r#"INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id,
                                   aggregate_version, payload, activity_id, status, delivery)
         VALUES ($1, 't', 'ORDER_PAID', $2, $2, 2, '{"v": 1}', 1403, 'TRANSACTION', 'transaction')"#,
        &[&event_id, &oid],
    )
    .await
    .unwrap();
    let checker = Arc::new(checker);
    let asking = {
        let (checker, msg) = (checker.clone(), check_of(&oid, &event_id, past));
        tokio::spawn(async move { checker.check(&msg).await })
    };
    let watcher = env.pool(1).await;
    eventually(10, "the check waits for the order's row lock", || async {
        let c = watcher.get().await.unwrap();
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%FROM orders WHERE order_id = $1 FOR SHARE%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        waiting > 0
    })
    .await;
    assert!(!asking.is_finished(), "it did not answer before the commit");
    tx.commit().await.unwrap();
    assert_eq!(asking.await.unwrap(), LocalOutcome::Commit);

    // A lock held past the check's lock timeout: UNKNOWN (the broker asks again), not a guess.
    let tx = local.transaction().await.unwrap();
    tx.execute(
        "UPDATE orders SET updated_at = now() WHERE order_id = $1",
        &[&oid],
    )
    .await
    .unwrap();
    tx.execute("DELETE FROM event_outbox WHERE event_id = $1", &[&event_id])
        .await
        .unwrap();
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Unknown
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Commit,
        "the row is still there"
    );
    // The row holds another payload under this id (another attempt's event): this half's
    // transaction did not write it, whatever the deadline.
    let mut other = check_of(&oid, &event_id, ahead);
    other.body = br#"{"v": 2}"#.to_vec();
    assert_eq!(checker.check(&other).await, LocalOutcome::Rollback);
    env.cleanup().await;
}
