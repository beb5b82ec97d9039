//! Uncertain stays uncertain (docs/architecture/hot-path.md#uncertain-sends): once a send of a
//! reservation's message may have been stored, no later refusal by the broker releases the
//! unit; only PostgreSQL, after the reservation's validity, can prove it free. The send
//! outcomes are forced with the `mq-send-outcome` failpoint against the real broker, so this is
//! its own test binary (built with `--features failpoints`, which `make test` uses).

use std::sync::Arc;

use crate::common::{eventually, reserve_only, TestEnv};
use chrono::Utc;
use deadpool_redis::redis::AsyncCommands;
use seckill::domain::Decision;
use seckill::pg::order_tx::{process_batch, Inbound, TxNames};
use seckill::redis::RedisStore;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::{event_from_reservation, Scanner};

/// The failpoint is process-wide: one test configures it at a time.
static FAILPOINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn force(message_id: &str, mode: &str) {
    fail::cfg("mq-send-outcome", &format!("return({message_id}:{mode})")).unwrap();
}

/// Makes the reservation due for the scanner now.
async fn due_now(redis: &RedisStore, activity_id: i64, reservation_id: &str) {
    let mut c = redis.pool.get().await.unwrap();
    let _: () = c
        .zadd(redis.keys.pending(activity_id), reservation_id, 0)
        .await
        .unwrap();
}

/// Moves the reservation's validity into the past, beyond the settle grace.
async fn expire(env: &TestEnv, redis: &RedisStore, activity_id: i64, reservation_id: &str) {
    let past = Utc::now().timestamp_millis() - env.settings.scan.settle_grace_ms as i64 - 1_000;
    let mut c = redis.pool.get().await.unwrap();
    let _: () = c
        .hset(
            redis.keys.reservation(activity_id, reservation_id),
            "valid_until",
            past,
        )
        .await
        .unwrap();
}

async fn pg_remaining(env: &TestEnv, activity_id: i64) -> i64 {
    env.count(&format!(
        "SELECT remaining_stock::bigint FROM sku_stock WHERE activity_id = {activity_id} AND sku_id = 1"
    ))
    .await
}

async fn scanner(env: &TestEnv, redis: &RedisStore) -> Scanner {
    let publisher = seckill::mq::connect_publisher(&env.settings).await;
    Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher.unwrap(),
        Arc::new(env.settings.clone()),
    )
}

/// A send that may have reached the broker makes its reservation uncertain. Later refusals hold its
/// unit until PostgreSQL fences the message after the validity and the grace; the unit then comes
/// back once and a late copy makes no order.
///
/// One story: each scan pass meets the reservation as the pass before left it, and the late copy
/// and the release read what the fence wrote.
#[tokio::test]
async fn a_refusal_after_a_lost_send_holds_the_unit_until_postgresql_fences_the_message() {
    let _one = FAILPOINT.lock().await;
    let env = TestEnv::with_topics().await;
    env.activity(970, 1, 5).await;
    let redis = env.redis().await;
    let r = reserve_only(&redis, 970, 1, 0).await;
    let scanner = scanner(&env, &redis).await;

    // First attempt: the request never reached the broker, but the sender cannot know.
    force(&r.message_id, "lost");
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!(stats.unknown, 1, "{stats:?}");
    let h = redis.reservation(970, &r.reservation_id).await.unwrap();
    assert_eq!(h["uncertain"], "1", "{h:?}");
    // The API's own refusal path cannot release it either.
    let verdict = redis
        .sends()
        .mark_failed(970, 1, &r.reservation_id, &r.message_id, "refused", 0)
        .await
        .unwrap();
    assert_eq!(verdict, "UNCERTAIN");

    // The re-send is refused while the reservation is valid: held, tried again later.
    force(&r.message_id, "refused");
    due_now(&redis, 970, &r.reservation_id).await;
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!((stats.failed, stats.settled), (1, 0), "{stats:?}");
    // Refused again after the validity and the grace: PostgreSQL settles it.
    expire(&env, &redis, 970, &r.reservation_id).await;
    due_now(&redis, 970, &r.reservation_id).await;
    let held = redis.reservation(970, &r.reservation_id).await.unwrap();
    assert_eq!(
        (held["status"].as_str(), held["mq_status"].as_str()),
        ("RESERVED", "MQ_PENDING"),
        "refusals alone never release an uncertain reservation: {held:?}"
    );
    assert_eq!(redis.stock().sku_stock(970, 1).await.unwrap(), Some((5, 4)));
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!(stats.settled, 1, "{stats:?}");

    // No copy had reached the consumer: the inbox is fenced, the decision recorded, the unit
    // back exactly once.
    let h = redis.reservation(970, &r.reservation_id).await.unwrap();
    assert_eq!(
        (
            h["status"].as_str(),
            h["mq_status"].as_str(),
            h["release_reason"].as_str()
        ),
        ("RELEASED", "MQ_FENCED", "SEND_FENCED"),
        "{h:?}"
    );
    assert_eq!(redis.stock().sku_stock(970, 1).await.unwrap(), Some((5, 5)));
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM reservations WHERE reservation_id = '{}' AND status = 'REJECTED' AND reject_reason = 'WITHDRAWN'",
            r.reservation_id
        ))
        .await,
        1
    );
    // A copy that turns up later (the broker had it after all) creates nothing.
    let event = event_from_reservation(&h, 1).unwrap();
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    let late = Inbound {
        raw_body: event.encode(),
        event: Ok(event),
        properties: serde_json::json!({}),
        property_message_id: None,
        broker_msg_id: "late".into(),
        delivery_attempt: 3,
    };
    let decisions = process_batch(
        &mut c,
        &TxNames::order_create(&env.settings),
        &[late],
        Utc::now(),
        chrono::Duration::seconds(60),
    )
    .await
    .unwrap();
    assert_eq!(decisions, vec![Decision::DuplicateMessage]);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);
    // The compensation row the rejection wrote finds the unit already back: a no-op.
    let again = redis
        .sends()
        .release_many(
            &[seckill::redis::Release {
                activity_id: 970,
                sku_id: 1,
                reservation_id: &r.reservation_id,
                reason: "EXPIRED",
            }],
            0,
        )
        .await
        .unwrap();
    assert_eq!(again, vec!["ALREADY_RELEASED".to_string()]);
    assert_eq!(redis.stock().sku_stock(970, 1).await.unwrap(), Some((5, 5)));
    fail::remove("mq-send-outcome");
    drop(c);
    env.cleanup().await;
}

#[tokio::test]
async fn a_refusal_after_a_stored_but_unanswered_send_keeps_the_unit_of_the_order_it_became() {
    let _one = FAILPOINT.lock().await;
    let env = TestEnv::with_topics().await;
    env.activity(971, 1, 5).await;
    let redis = env.redis().await;
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let r = reserve_only(&redis, 971, 1, 0).await;
    let scanner = scanner(&env, &redis).await;

    // The broker stores the copy, but its answer is lost: UNKNOWN.
    force(&r.message_id, "stored-unanswered");
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!(stats.unknown, 1, "{stats:?}");
    // That copy becomes an order; nothing has told Redis yet (no projection runs here).
    eventually(30, "the stored copy became an order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    consumer.shutdown().await;

    // Later re-sends are refused, after the reservation's validity (e.g. its route dropped
    // while the broker was away). Releasing now would give a second buyer the order's unit.
    force(&r.message_id, "refused");
    expire(&env, &redis, 971, &r.reservation_id).await;
    due_now(&redis, 971, &r.reservation_id).await;
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!(stats.settled, 1, "{stats:?}");
    let h = redis.reservation(971, &r.reservation_id).await.unwrap();
    assert_eq!(
        (h["status"].as_str(), h["mq_status"].as_str()),
        ("RESERVED", "MQ_SENT"),
        "a copy was consumed: its unit stays with the order: {h:?}"
    );
    assert_eq!(redis.recovery().pending_count(971).await.unwrap(), 0);
    assert_eq!(redis.stock().sku_stock(971, 1).await.unwrap(), Some((5, 4)));
    assert_eq!(
        pg_remaining(&env, 971).await,
        4,
        "Redis and PostgreSQL agree"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM reservations WHERE status = 'ORDERED'")
            .await,
        1
    );
    fail::remove("mq-send-outcome");
    env.cleanup().await;
}
