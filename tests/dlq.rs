//! The DLQ loop's intake on the real broker: a message that fails every time lands in the
//! group's %DLQ% topic after its retries, is recorded in PostgreSQL with the error that
//! killed it, counts in the gauge's source, and can be listed and discarded (audited).

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

use std::sync::Arc;

use common::{event, eventually, spawn, TestEnv};
use seckill::mq::order_create_message;
use seckill::roles::consume::OrderCreateHandler;

#[tokio::test]
async fn a_message_failing_every_time_is_dead_lettered_recorded_and_discardable() {
    let mut env = TestEnv::new(true).await;
    env.settings.consumer.max_reconsume_times = 1;
    env.settings.pg.statement_timeout_ms = 200;
    env.activity(950, 1, 5).await;
    let names = env.settings.names();

    // Every attempt times out on the locked stock row: a transient failure, each time.
    let locker_pool = env.pool(1).await;
    let mut locker = locker_pool.get().await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.execute("SELECT 1 FROM activity_skus FOR UPDATE", &[])
        .await
        .unwrap();

    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let intakes = seckill::roles::dlq::start_intakes(&env.settings, env.pool(2).await)
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
        seckill::pg::dlq::open_stats(&**c).await.unwrap().0,
        1,
        "mq_dlq_messages = 1"
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    // The operator's view and decision, through the binary.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"))
        .args(["dlq", "list", "--json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__ENV", &env.settings.env)
        .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["message_id"], e.message_id.as_str());
    let id = listed[0]["dlq_id"].as_i64().unwrap().to_string();
    let mut discard = spawn(
        &env,
        &[
            "dlq",
            "discard",
            &id,
            "--reason",
            "test: stock row was locked",
            "--actor",
            "tester",
        ],
        "",
        &[],
    );
    assert!(discard.wait_exit(30).await.success());
    assert_eq!(seckill::pg::dlq::open_stats(&**c).await.unwrap().0, 0);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'DISCARD' AND actor = 'tester'")
            .await,
        1
    );
    let mut again = spawn(&env, &["dlq", "discard", &id, "--reason", "twice"], "", &[]);
    assert!(
        !again.wait_exit(30).await.success(),
        "only an OPEN dead letter can be discarded"
    );

    drop(c);
    consumer.shutdown().await;
    for i in intakes {
        i.shutdown().await;
    }
    env.cleanup().await;
}
