//! A replay an operator controls: `--activity` replays one sale's dead letters and leaves the
//! other's, `--pause` holds the running command before its next message, `--resume` lets it go
//! on where it stopped; its progress is in `replay_batches` as it goes.

use crate::common::{self, event, eventually, TestEnv};
use seckill::mq::order_create_message;

use super::groups::dead_letter;

/// `replay_batches`' one row: (batch id, status, sent, total, held).
async fn batch(c: &tokio_postgres::Client) -> Option<(String, String, i32, i32, bool)> {
    c.query_opt(
        "SELECT batch_id, status, sent, total, held_at IS NOT NULL FROM replay_batches",
        &[],
    )
    .await
    .unwrap()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
}

/// One sale's six dead letters replayed at one a second, paused after two or more: nothing is
/// sent while it holds (no audit row in the window, the progress unchanged), and once resumed
/// the rest go, each once; the other sale's two stay open.
#[tokio::test]
async fn a_paused_replay_sends_nothing_until_resumed_and_then_finishes_where_it_stopped() {
    let env = TestEnv::with_topics().await;
    env.activity(1720, 1, 10).await;
    env.activity(1721, 1, 10).await;
    let names = env.names();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let group = names.order_create_group.clone();
    for (i, (activity, user)) in (1..=6)
        .map(|u| (1720, u))
        .chain([(1721, 7), (1721, 8)])
        .enumerate()
    {
        let m = order_create_message(&names.order_create_topic, &event(activity, 1, user, 300));
        dead_letter(&c, &group, &m, i as i64, "lock timeout", 30.0 - i as f64).await;
    }
    let args = [
        "dlq",
        "replay",
        "--group",
        group.as_str(),
        "--activity",
        "1720",
        "--sample",
        "0",
        "--rate",
        "1",
        "--verify-secs",
        "1",
        "--reason",
        "lock fixed",
        "--actor",
        "tester",
    ];
    let mut replay = common::spawn(&env, &args, "", &[]);
    eventually(30, "the replay has sent two", || async {
        batch(&c).await.is_some_and(|b| b.2 >= 2)
    })
    .await;
    let (id, ..) = batch(&c).await.unwrap();
    let out = common::cli(&env, &["dlq", "replay", "--pause", &id, "--actor", "ops"]);
    assert!(out.status.success(), "{out:?}");
    eventually(10, "the command holds", || async {
        batch(&c).await.is_some_and(|b| b.4)
    })
    .await;
    let (_, status, held_at_sent, total, _) = batch(&c).await.unwrap();
    assert_eq!((status.as_str(), total), ("PAUSED", 6));
    // Held for more than two messages' time at the replay's rate.
    eventually(10, "2.5 s held", || async {
        env.count("SELECT count(*) FROM replay_batches WHERE held_at < now() - interval '2.5 s'")
            .await
            == 1
    })
    .await;
    let out = common::cli(&env, &["dlq", "replay", "--resume", &id, "--actor", "ops"]);
    assert!(out.status.success(), "{out:?}");
    assert!(replay.wait_exit(60).await.success());

    let (_, status, sent, ..) = batch(&c).await.unwrap();
    assert_eq!((status.as_str(), sent), ("DONE", 6));
    assert!(held_at_sent < 6, "paused with {held_at_sent} of 6 sent");
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit a, replay_batches b
             WHERE a.replay_batch_id = '{id}' AND a.at > b.held_at
               AND a.at < (SELECT min(at) FROM admin_audit
                                   WHERE action = 'replay_resume')"
        ))
        .await,
        0,
        "nothing sent while held"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(DISTINCT dlq_id) FROM dlq_audit WHERE replay_batch_id = '{id}'"
        ))
        .await,
        6
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE replay_batch_id = '{id}'"
        ))
        .await,
        6,
        "each sent once"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        2,
        "the other sale's two stay open"
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM admin_audit WHERE actor = 'ops'
             AND action IN ('replay_pause', 'replay_resume')"
        )
        .await,
        2
    );
    // A batch that is not paused is not resumed: said, nothing changed.
    let out = common::cli(&env, &["dlq", "replay", "--resume", &id, "--actor", "ops"]);
    assert!(!out.status.success());
    drop(c);
    env.cleanup().await;
}
