//! What the roles do once they see a PostgreSQL failover
//! (docs/architecture/recovery.md#after-a-postgresql-failover), without one: the primary each
//! role reads, the scanner's sweep over every watched send, and a loss found past the repair
//! horizon. The failover itself, with a real manager, is in `pg_failover` (make test-faults).

use std::sync::Arc;

use chrono::Utc;

use crate::common::{eventually, reserve_only, TestEnv};
use crate::recovery::Progress;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::Scanner;

fn scanner(
    env: &TestEnv,
    redis: &seckill::redis::RedisStore,
    pool: deadpool_postgres::Pool,
    publisher: Arc<dyn seckill::mq::Publisher>,
) -> Scanner {
    Scanner::new(
        redis.clone(),
        pool,
        publisher,
        Arc::new(env.settings.clone()),
    )
    .with_progress(Arc::new(Progress(Some(i64::MAX))))
}

#[tokio::test]
async fn each_role_reads_the_server_it_writes_to_and_its_timeline() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let p = seckill::pg::primary::read(&client).await.unwrap();
    let port: i32 = client
        .query_one("SELECT inet_server_port()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(p.host, format!("127.0.0.1:{port}"));
    assert!(p.timeline >= 1, "{p:?}");
    drop(client);
    // The watch publishes it and counts no failover while the server stays the same.
    let stop = tokio_util::sync::CancellationToken::new();
    let failovers =
        seckill::pg::primary::spawn(pool, std::time::Duration::from_millis(100), stop.clone());
    tokio::time::sleep(std::time::Duration::from_millis(350)).await;
    assert_eq!(failovers.seen(), 0);
    stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn after_a_failover_every_watched_send_is_checked_at_once_whatever_its_age() {
    let mut env = TestEnv::with_topics().await;
    // The regular passes would look at these only a minute after the group's progress.
    env.settings.scan.unconsumed_resend_ms = 60_000;
    env.activity(31, 1, 50).await;
    let redis = env.redis().await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    // Two reservations the broker confirmed a moment ago. The first became an order; the
    // second's order was committed by a primary that died before shipping it (here: its
    // message never reached the consumers at all, which looks the same from the scanner).
    let now = Utc::now().timestamp_millis();
    let (_, lost) =
        crate::recovery::one_taken_one_stranded(&env, &redis, &publisher, 31, now).await;
    let scanner = scanner(&env, &redis, env.pool(1).await, publisher.clone());
    // A regular pass: nothing is due yet.
    assert_eq!(
        scanner.scan_once().await.unwrap().awaiting,
        Default::default()
    );
    // The sweep after a failover: the taken one leaves the watch, the other is sent again.
    let swept = scanner.after_failover().await.unwrap();
    assert_eq!(
        (swept.consumed, swept.resent, swept.settled, swept.lost),
        (1, 1, 0, 0),
        "{swept:?}"
    );
    eventually(
        30,
        "the lost reservation's order, created again",
        || async { env.count("SELECT count(*) FROM orders").await == 2 },
    )
    .await;
    let pool = env.pool(1).await;
    let oid: String = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT order_id FROM consumer_inbox WHERE message_id = $1",
            &[&lost.message_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(oid, lost.order_id, "the same ids as reserved");
    // Swept again at once: the re-sent copy is newer than the sweep, nothing more to do.
    let again = scanner.after_failover().await.unwrap();
    assert_eq!((again.resent, again.settled), (0, 0), "{again:?}");
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_loss_found_past_the_horizon_is_reported_by_name_not_settled_silently() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.unconsumed_resend_ms = 1_000;
    env.settings.scan.settle_grace_ms = 0;
    env.activity(32, 1, 5).await;
    let redis = env.redis().await;
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    // A buyer told 202: its reservation was confirmed sent, and no order exists for it in
    // PostgreSQL (a commit lost with the old primary). Its validity ended a minute ago.
    let ids = reserve_only(&redis, 32, 7, 60_000).await;
    let sent_at = Utc::now().timestamp_millis() - 120_000;
    redis
        .sends()
        .mark_sent(32, &ids.reservation_id, &ids.message_id, "b-1", sent_at)
        .await
        .unwrap();
    let key = redis.keys.reservation(32, &ids.reservation_id);
    let mut conn = redis.pool.get().await.unwrap();
    let past = (Utc::now().timestamp_millis() - 60_000).to_string();
    let _: () = deadpool_redis::redis::AsyncCommands::hset(&mut *conn, &key, "valid_until", &past)
        .await
        .unwrap();
    drop(conn);
    let scanner = scanner(&env, &redis, env.pool(1).await, publisher);
    let swept = scanner.after_failover().await.unwrap();
    // Settled, and counted as lost (the alert SeckillReservationLostPastHorizon reads the
    // counter; the scan role's log names the buyer, reservation and order).
    assert_eq!(
        (swept.settled, swept.lost, swept.resent),
        (1, 1, 0),
        "{swept:?}"
    );
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let (status, orders): (String, i64) = {
        let r = c
            .query_one(
                "SELECT r.status, (SELECT count(*) FROM orders o WHERE o.reservation_id = r.reservation_id)
                 FROM reservations r WHERE r.reservation_id = $1",
                &[&ids.reservation_id],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((status.as_str(), orders), ("REJECTED", 0));
    drop(c);
    env.cleanup().await;
}
