//! The DLQ intake end to end: a message failing every time (a locked stock row) is dead-lettered
//! by the broker after its retries, recorded in PostgreSQL with the error that killed it and its
//! raw payload, counted in the gauge's source, listed by `seckill dlq list`, replayed (twice, one
//! effect; past the inbox retention refused unless forced) and discarded (audited,
//! `ALREADY_DECIDED`, never twice).

use crate::common;

use std::sync::Arc;

use crate::common::{event, eventually, TestEnv};
use seckill::mq::order_create_message;
use seckill::roles::consume::order_create::OrderCreateHandler;

/// A message that fails every time is dead-lettered and recorded. Replayed twice once its cause is
/// gone, it makes one order; replayed past retention it makes none; then it is discarded.
///
/// One story: every replay and the discard act on the one dead letter the locked stock row
/// produced, and each reads what the step before it left.
#[tokio::test]
async fn a_message_failing_every_time_is_dead_lettered_recorded_and_discardable() {
    let mut env = TestEnv::with_topics().await;
    env.settings.consumer.max_reconsume_times = 1;
    env.settings.pg.statement_timeout_ms = 200;
    env.activity(950, 1, 5).await;
    let names = env.names();

    // Every attempt times out on the locked stock row: a transient failure, each time.
    let locker_pool = env.pool(1).await;
    let mut locker = locker_pool.get().await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.execute("SELECT 1 FROM stock_buckets FOR UPDATE", &[])
        .await
        .unwrap();

    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let intakes =
        seckill::roles::consume::dlq_intake::start_intakes(&env.settings, env.pool(2).await)
            .await
            .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let e = event(950, 1, 42, 300);
    let sent = publisher
        .send(order_create_message(&names.order_create_topic, &e), 3000)
        .await;
    assert!(
        matches!(sent, seckill::mq::SendOutcome::Confirmed { .. }),
        "{sent:?}"
    );

    eventually(90, "the dead letter is recorded", || async {
        env.count("SELECT count(*) FROM dlq_messages").await == 1
    })
    .await;
    lock.rollback().await.unwrap();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    assert_recorded(&c, &names, &e).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    // The operator's view and decisions, through the binary.
    let run = |args: &[&str]| common::cli(&env, args);
    let out = run(&["dlq", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["message_id"], e.message_id.as_str());
    let id = listed[0]["dlq_id"].as_i64().unwrap().to_string();

    // The cause is fixed (the lock is gone): replay makes exactly one order, and so does a
    // second replay of the same dead letter.
    for _ in 0..2 {
        // It watches the inbox for the effect while this test's consumer works.
        let out = common::cli_async(
            &env,
            &[
                "dlq",
                "replay",
                "--id",
                &id,
                "--reason",
                "lock released",
                "--actor",
                "tester",
                "--verify-secs",
                "30",
            ],
        )
        .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eventually(30, "the replayed order", || async {
            env.count("SELECT count(*) FROM orders").await == 1
        })
        .await;
    }
    // Both replays consumed: a second order could no longer appear.
    let names = env.names();
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "one effect for two replays"
    );
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND outcome = 'CONFIRMED' AND replay_id LIKE 'rpl_%'").await,
        2
    );
    // Each replay's audit row says what came of it: the first made the order, the second
    // found the inbox already holding the message.
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND effect = 'APPLIED:CREATED' AND checks->>'already_applied' IS NULL").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND effect = 'DUPLICATE' AND checks->>'already_applied' = 'SUCCEEDED/CREATED'").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'REPLAYED'")
            .await,
        1
    );

    replay_past_retention(&env, &c, &id).await;
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    // What the consume role exports as mq_dlq_replay_total{result}: the CLI is not scraped.
    assert_eq!(
        seckill::pg::dlq::replay_counts(&**c).await.unwrap(),
        vec![("confirmed".to_owned(), 3), ("refused".to_owned(), 1)]
    );

    discard_once(&env, &c, &id).await;

    drop(c);
    consumer.shutdown().await;
    for i in intakes {
        i.shutdown().await;
    }
    env.cleanup().await;
}

/// The dead letter's row: where it came from, why it died, its raw payload, OPEN.
async fn assert_recorded(
    c: &tokio_postgres::Client,
    names: &seckill::mq::Names,
    e: &seckill::domain::OrderCreateRequested,
) {
    let r = c
        .query_one(
            "SELECT consumer_group, topic, message_id, reservation_id, attempts, error_class, last_error, payload, status
             FROM dlq_messages",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), names.order_create_group);
    assert_eq!(r.get::<_, String>(1), names.order_create_topic);
    assert_eq!(
        r.get::<_, Option<String>>(2).as_deref(),
        Some(e.message_id.as_str())
    );
    assert_eq!(
        r.get::<_, Option<String>>(3).as_deref(),
        Some(e.reservation_id.as_str())
    );
    assert!(r.get::<_, i32>(4) >= 1);
    assert_eq!(r.get::<_, Option<String>>(5).as_deref(), Some("transient"));
    assert!(
        r.get::<_, Option<String>>(6)
            .unwrap_or_default()
            .contains("57014"),
        "the error that killed it"
    );
    assert_eq!(r.get::<_, Vec<u8>>(7), e.encode(), "raw payload kept");
    assert_eq!(r.get::<_, String>(8), "OPEN");
    assert_eq!(
        seckill::pg::dlq::open_stats(c).await.unwrap().0,
        1,
        "mq_dlq_messages = 1"
    );
}

/// Discard: only an OPEN dead letter, audited; a second discard is refused.
async fn discard_once(env: &TestEnv, c: &tokio_postgres::Client, id: &str) {
    let run = |args: &[&str]| common::cli(env, args);
    c.execute("UPDATE dlq_messages SET status = 'OPEN'", &[])
        .await
        .unwrap();
    let out = run(&[
        "dlq",
        "discard",
        id,
        "--reason",
        "test: done",
        "--actor",
        "tester",
    ]);
    assert!(out.status.success());
    assert_eq!(seckill::pg::dlq::open_stats(c).await.unwrap().0, 0);
    // Its message had become an order: the discard gives nothing back.
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'DISCARD' AND actor = 'tester' AND effect = 'ALREADY_DECIDED'")
            .await,
        1
    );
    assert!(!run(&["dlq", "discard", id, "--reason", "twice"])
        .status
        .success());
}

/// Older than the inbox retention: a replay is refused, unless forced (and audited as forced).
async fn replay_past_retention(env: &TestEnv, c: &tokio_postgres::Client, id: &str) {
    let run = |args: &[&str]| common::cli(env, args);
    c.execute(
        "UPDATE dlq_messages SET first_seen = now() - interval '30 days'",
        &[],
    )
    .await
    .unwrap();
    let out = run(&[
        "dlq", "replay", "--id", id, "--reason", "old", "--actor", "tester",
    ]);
    assert!(!out.status.success(), "refused");
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE outcome = 'REFUSED_OLDER_THAN_RETENTION'")
            .await,
        1
    );
    let out = run(&[
        "dlq",
        "replay",
        "--id",
        id,
        "--reason",
        "old, on purpose",
        "--actor",
        "tester",
        "--force",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE outcome = 'CONFIRMED_FORCED'")
            .await,
        1
    );
}
