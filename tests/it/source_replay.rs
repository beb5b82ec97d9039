//! Replay from the source topic (docs/architecture/recovery.md#dead-letters): messages the
//! order-create group moved past without applying them (its offsets pushed to the end, as an
//! operator's reset or a restored database leaves them) are found in the topic itself by time
//! window or business key, read through the replay group, and sent again; the inbox applies each
//! once and every send is audited under one batch id, naming where the broker stored the message.

use cheetah_string::CheetahString;
use chrono::Utc;
use rocketmq_client_rust::{DefaultMQAdminExt, OffsetAdmin, TopicAdmin};

use crate::common::{self, eventually, spawn_consume, TestEnv};
use seckill::mq::order_create_message;

/// Moves `group`'s committed offsets on `topic` to the end of every queue: whatever it has not
/// consumed yet, it never will.
async fn skip_to_end(env: &TestEnv, group: &str, topic: &str) {
    let rt = seckill::mq::runtime().unwrap();
    let mut admin = DefaultMQAdminExt::new(rt.client_runtime());
    admin.set_namesrv_addr(env.settings.mq.name_server_list());
    admin.start().await.unwrap();
    let broker = CheetahString::from(env.settings.mq.broker_addrs().next().unwrap());
    let stats = admin
        .examine_topic_stats(CheetahString::from(topic), None)
        .await
        .unwrap();
    for (mq, offsets) in stats.get_offset_table() {
        admin
            .update_consume_offset(
                broker.clone(),
                CheetahString::from(group),
                mq.clone(),
                offsets.get_max_offset() as u64,
            )
            .await
            .unwrap();
    }
    admin.shutdown().await;
}

/// `seckill dlq replay --from-source --since <since> <more>`: whether it succeeded, its stdout
/// and stderr.
async fn replay_from_source(env: &TestEnv, since: &str, more: &[&str]) -> (bool, String, String) {
    let mut args = vec!["dlq", "replay", "--from-source", "--since", since];
    args.extend_from_slice(more);
    let out = common::cli_async(env, &args).await;
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Sends `n` ORDER_CREATE_REQUESTED for users from `first`; their events.
async fn send_orders(
    env: &TestEnv,
    first: i64,
    n: i64,
) -> Vec<seckill::domain::OrderCreateRequested> {
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let topic = env.names().order_create_topic;
    let mut sent = Vec::new();
    for user in first..first + n {
        let e = common::event(960, 1, user, 300);
        let outcome = publisher.send(order_create_message(&topic, &e), 3000).await;
        assert!(
            matches!(outcome, seckill::mq::SendOutcome::Confirmed { .. }),
            "{outcome:?}"
        );
        sent.push(e);
    }
    sent
}

/// Messages a consumer group skipped are read back from the source topic and replayed by time
/// window under one batch id. A replay by key with applied messages included is a no-op.
///
/// One story: the replays read back the window in which the applied and the skipped messages were
/// sent, and each replay finds what the one before it left.
#[tokio::test]
async fn messages_a_group_skipped_are_replayed_from_the_source_topic_by_window_and_by_key() {
    let env = TestEnv::with_topics().await;
    env.activity(960, 1, 100).await;
    let names = env.names();
    let since = (Utc::now() - chrono::Duration::seconds(2)).to_rfc3339();
    // Three applied the normal way.
    let applied = send_orders(&env, 1, 3).await;
    let (mut consume, _) = spawn_consume(&env, "2", "");
    eventually(60, "three orders", || async {
        env.count("SELECT count(*) FROM orders").await == 3
    })
    .await;
    assert!(consume.terminate(40).await.success());
    // Three the group moves past without applying.
    let skipped = send_orders(&env, 4, 3).await;
    skip_to_end(&env, &names.order_create_group, &names.order_create_topic).await;

    // The dry run reads the whole window back and lists only what the inbox lacks.
    let (ok, dry, err) = replay_from_source(&env, &since, &["--dry-run", "--json"]).await;
    assert!(ok, "{err}");
    let listed: Vec<serde_json::Value> = serde_json::from_str(&dry).unwrap();
    let mut ids: Vec<&str> = listed
        .iter()
        .map(|c| c["message_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut want: Vec<&str> = skipped.iter().map(|e| e.message_id.as_str()).collect();
    want.sort();
    assert_eq!(ids, want, "the skipped three, not the applied ones");
    assert!(err.contains("read 6 message(s)"), "{err}");

    // The consumer runs again (from the end: it will not see them), and the replay sends them.
    let (mut consume, port) = spawn_consume(&env, "2", "");
    common::wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let (ok, stdout, err) = replay_from_source(
        &env,
        &since,
        &[
            "--reason",
            "skipped by an offset reset",
            "--sample",
            "1",
            "--verify-secs",
            "30",
        ],
    )
    .await;
    assert!(ok, "{stdout}{err}");
    assert!(stdout.contains("3 confirmed (3 applied"), "{stdout}");
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 6);
    let topic = &names.order_create_topic;
    assert_eq!(
        env.count(&format!(
            "SELECT count(DISTINCT replay_batch_id) FROM dlq_audit \
             WHERE source_ref LIKE '{topic}@%' AND effect = 'APPLIED:CREATED'"
        ))
        .await,
        1,
        "three replays under one batch id, each applied"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE source_ref IS NOT NULL")
            .await,
        3
    );

    // By key, with what was applied included: one message, a no-op.
    let key = &applied[1].reservation_id;
    let (ok, stdout, _) = replay_from_source(
        &env,
        &since,
        &[
            "--key",
            key,
            "--include-applied",
            "--reason",
            "check one",
            "--verify-secs",
            "5",
        ],
    )
    .await;
    assert!(ok, "{stdout}");
    assert!(
        stdout.contains("1 confirmed (0 applied, 1 duplicate"),
        "{stdout}"
    );
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 6);
    assert!(consume.terminate(40).await.success());
    env.cleanup().await;
}
