//! The re-send scanner (docs/architecture/recovery.md#re-send-scanner): it sends, with the
//! same message id, what the API reserved but never sent, two scanners never take the same
//! reservation and a dead scanner's leases come back; it sends again a confirmed send the
//! order-create consumers never took; an activity that ended long ago with nothing pending
//! leaves its list.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use super::Progress;
use crate::common::{eventually, reserve_only, TestEnv};
use chrono::Utc;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::Scanner;

/// A consumer of the test's order-create topic, and the publisher a scanner sends with.
async fn sending(env: &TestEnv) -> (Arc<dyn seckill::mq::Publisher>, seckill::mq::ConsumerHandle) {
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    (publisher, consumer)
}

async fn scanner(env: &TestEnv, publisher: &Arc<dyn seckill::mq::Publisher>) -> Scanner {
    Scanner::new(
        env.redis().await,
        env.pool(1).await,
        publisher.clone(),
        Arc::new(env.settings.clone()),
    )
}

/// A reservation the API never sent is sent by the scanner with the ids it was reserved with,
/// and becomes its one order.
#[tokio::test]
async fn the_scanner_sends_what_the_api_never_sent_with_the_same_message_id() {
    let env = TestEnv::with_topics().await;
    env.activity(10, 1, 50).await;
    let redis = env.redis().await;
    let (publisher, consumer) = sending(&env).await;

    let lost = reserve_only(&redis, 10, 1, 0).await;
    let scanner = scanner(&env, &publisher).await;
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!((stats.claimed, stats.confirmed), (1, 1));
    eventually(30, "the order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let (mid, oid): (String, String) = {
        let r = c
            .query_one("SELECT message_id, order_id FROM consumer_inbox", &[])
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (mid, oid),
        (lost.message_id.clone(), lost.order_id.clone()),
        "same ids as reserved"
    );
    assert_eq!(
        redis.reservation(10, &lost.reservation_id).await.unwrap()["mq_status"],
        "MQ_SENT"
    );
    assert_eq!(
        scanner.scan_once().await.unwrap().claimed,
        0,
        "nothing left to send"
    );
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

/// Two scanners at once never take the same reservation, and the leases of a scanner that
/// died are taken over only once they expire; every reservation becomes one order.
#[tokio::test]
async fn scanners_share_the_due_reservations_by_lease() {
    let env = TestEnv::with_topics().await;
    env.activity(10, 1, 50).await;
    let redis = env.redis().await;
    let (publisher, consumer) = sending(&env).await;

    for user in 100..120 {
        reserve_only(&redis, 10, user, 0).await;
    }
    let a = scanner(&env, &publisher).await;
    let b = scanner(&env, &publisher).await;
    let (sa, sb) = tokio::join!(a.scan_once(), b.scan_once());
    let (sa, sb) = (sa.unwrap(), sb.unwrap());
    assert_eq!(sa.claimed + sb.claimed, 20, "{sa:?} {sb:?}");

    // A scanner that dies holding leases: nobody sends them until the lease expires.
    for user in 200..205 {
        reserve_only(&redis, 10, user, 0).await;
    }
    let held = redis
        .recovery()
        .claim_due(10, Utc::now().timestamp_millis(), 100, "dead-scanner", 1500)
        .await
        .unwrap()
        .reservations;
    assert_eq!(held.len(), 5);
    assert_eq!(
        b.scan_once().await.unwrap().claimed,
        0,
        "leased to the dead scanner"
    );
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert_eq!(
        b.scan_once().await.unwrap().confirmed,
        5,
        "taken over after the lease"
    );

    eventually(30, "25 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 25
    })
    .await;
    common::quiescent(&env, 10).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        25,
        "one order each"
    );
    consumer.shutdown().await;
    env.cleanup().await;
}

/// An activity that ended long ago with nothing pending leaves the scanner's list once, and its
/// keys start to expire; the others stay. Warming it again puts it back.
///
/// One story: the expiry checks read what the retiring pass set, and warming the activity again
/// undoes that same pass.
#[tokio::test]
async fn an_activity_that_ended_long_ago_with_nothing_pending_leaves_the_scanners_list() {
    let env = TestEnv::without_topics().await;
    let redis = env.redis().await;
    let now = Utc::now().timestamp_millis();
    let hour = 3_600_000;
    // 31: ended two hours ago, nothing pending. 32: ended as long ago, one reservation still
    // pending (its re-send is not due yet). 33: still on sale, nothing pending. 34: ended just
    // now, nothing pending (an API host with a lagging clock could still reserve).
    for (activity, ends) in [
        (31, now - 2 * hour),
        (32, now - 2 * hour),
        (33, now + hour),
        (34, now - 1000),
    ] {
        redis
            .stock()
            .warm(activity, 1, now - 3 * hour, ends, 60_000, 5, 1)
            .await
            .unwrap();
    }
    let mut conn = redis.pool.get().await.unwrap();
    let _: () = redis::AsyncCommands::zadd(
        &mut *conn,
        redis.keys.pending(32),
        "rsv_not_due",
        now + hour,
    )
    .await
    .unwrap();
    drop(conn);

    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = Scanner::new(
        redis.clone(),
        env.pool(1).await,
        publisher,
        Arc::new(env.settings.clone()),
    );
    let stats = scanner.scan_once().await.unwrap();
    assert_eq!((stats.retired, stats.claimed), (1, 0), "{stats:?}");
    let mut left = redis.activities().await.unwrap();
    left.sort();
    assert_eq!(left, vec![32, 33, 34]);
    assert_eq!(
        scanner.scan_once().await.unwrap().retired,
        0,
        "retired once"
    );
    // The retired activity's keys now expire (after retention.activity_keys_hours); the
    // others' do not.
    let keep = i64::from(env.settings.retention.activity_keys_hours) * 3600;
    let mut conn = redis.pool.get().await.unwrap();
    let ttl = |key: String| {
        let mut c = redis::cmd("TTL");
        c.arg(key);
        c
    };
    let retired: i64 = ttl(redis.keys.sku(31, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert!(retired > keep - 60 && retired <= keep, "TTL {retired}");
    let meta: i64 = ttl(redis.keys.meta(31))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert!(meta > 0, "TTL {meta}");
    let live: i64 = ttl(redis.keys.sku(33, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(live, -1, "a live activity's stock never expires");
    // Warming it again puts it back.
    redis
        .stock()
        .warm(31, 1, now - 3 * hour, now + hour, 60_000, 5, 1)
        .await
        .unwrap();
    assert!(redis.activities().await.unwrap().contains(&31));
    let revived: i64 = ttl(redis.keys.sku(31, 1))
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(revived, -1, "a sale warmed again no longer expires");
    drop(conn);
    env.cleanup().await;
}

#[tokio::test]
async fn a_confirmed_send_the_consumers_never_took_is_sent_again_with_the_same_message_id() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.unconsumed_resend_ms = 1_000;
    env.activity(11, 1, 50).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    // Two reservations the broker confirmed 20 s ago; only the first copy reached the
    // consumers (the second one's broker died holding it: it was never sent here at all).
    let sent_at = Utc::now().timestamp_millis() - 20_000;
    let (_, stranded) = super::one_taken_one_stranded(&env, &redis, &publisher, 11, sent_at).await;
    let scanner_with = |progress: Option<i64>| {
        let (redis, publisher, settings) = (redis.clone(), publisher.clone(), settings.clone());
        let env = &env;
        async move {
            Scanner::new(redis, env.pool(1).await, publisher, settings)
                .with_progress(Arc::new(Progress(progress)))
        }
    };
    // No reading of the group's progress: nothing is sent blind.
    let blind = scanner_with(None).await;
    assert_eq!(
        blind.scan_once().await.unwrap().awaiting,
        Default::default()
    );
    // The group has taken everything only up to before the sends: both may still be in line.
    let behind = scanner_with(Some(sent_at - 1)).await;
    assert_eq!(
        behind.scan_once().await.unwrap().awaiting,
        Default::default()
    );
    // Caught up (whenever asked): the first is in the inbox (watched no more), the second is
    // sent again.
    let scanner = scanner_with(Some(i64::MAX)).await;
    let stats = scanner.scan_once().await.unwrap().awaiting;
    assert_eq!(
        (stats.consumed, stats.resent, stats.settled),
        (1, 1, 0),
        "{stats:?}"
    );
    eventually(30, "the stranded reservation's order", || async {
        env.count("SELECT count(*) FROM orders").await == 2
    })
    .await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let oid: String = c
        .query_one(
            "SELECT order_id FROM consumer_inbox WHERE message_id = $1",
            &[&stranded.message_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(oid, stranded.order_id, "the same ids as reserved");
    // Watched again from its new copy; once that is due, the inbox has it and the watch ends.
    let last = std::cell::Cell::new(Default::default());
    eventually(10, "the re-sent one seen consumed", || async {
        last.set(scanner.scan_once().await.unwrap().awaiting);
        last.get().consumed == 1
    })
    .await;
    assert_eq!(last.get().resent, 0, "{:?}", last.get());
    let k = &redis.keys;
    let mut conn = redis.pool.get().await.unwrap();
    let watched: i64 = deadpool_redis::redis::AsyncCommands::zcard(&mut *conn, k.awaiting(11))
        .await
        .unwrap();
    assert_eq!(watched, 0, "nothing left to watch");
    consumer.shutdown().await;
    env.cleanup().await;
}
