//! Dead letters by failure: open dead letters and quarantined messages that failed the same way
//! form one group (`seckill dlq groups`); a group is replayed sample first under one batch id,
//! the rest held back until the sample is seen applied, or discarded whole.

use crate::common;

use std::sync::Arc;

use crate::common::{event, eventually, TestEnv};
use seckill::mq::order_create_message;
use seckill::roles::consume::order_create::OrderCreateHandler;

/// `seckill dlq groups`: open dead letters and quarantined messages that failed the same way
/// (ids and numbers aside) form one group with its count and oldest samples; handled ones
/// (replayed, discarded) are not work any more.
///
/// One story: the groups and the command's JSON are read from the same seeded rows, so the printout
/// is checked against the groups just computed.
#[tokio::test]
async fn dead_letters_failing_the_same_way_form_one_group() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    c.batch_execute(
        r#"INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                     error_class, last_error, payload, status, first_seen) VALUES
             ('CG_A', 't', 0, 1, 17, 'PERMANENT', 'order ord_01A not found', '{"schema_version":1}', 'OPEN', now() - interval '3 minutes'),
             ('CG_A', 't', 0, 2, 17, 'PERMANENT', 'order ord_01B not found', '{"schema_version":1}', 'OPEN', now() - interval '2 minutes'),
             ('CG_A', 't', 0, 3, 17, 'PERMANENT', 'order ord_01C not found', '{"schema_version":1}', 'OPEN', now() - interval '1 minute'),
             ('CG_A', 't', 0, 4, 17, 'PERMANENT', 'order ord_01D not found', '{"schema_version":1}', 'DISCARDED', now()),
             ('CG_A', 't', 0, 5, 17, 'TRANSIENT', 'statement timeout after 2000 ms', 'not json', 'OPEN', now());
           INSERT INTO quarantined_messages (consumer_group, topic, reason, error, raw_body) VALUES
             ('CG_A', 't', 'UNSUPPORTED_SCHEMA', 'schema_version 9 is newer than 2', '{"schema_version":9}'),
             ('CG_A', 't', 'UNSUPPORTED_SCHEMA', 'schema_version 9 is newer than 2', '{"schema_version":9}');"#,
    )
    .await
    .unwrap();
    let groups = seckill::roles::ops::dlq::failure_groups(&c, None, 1000)
        .await
        .unwrap();
    let seen: Vec<(&str, &str, usize, Option<i64>, &str)> = groups
        .iter()
        .map(|g| {
            let (source, class) = (g.source, g.class.as_str());
            (source, class, g.count, g.schema_version, g.message.as_str())
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                "dead_letter",
                "PERMANENT",
                3,
                Some(1),
                "order <id> not found"
            ),
            (
                "quarantined",
                "UNSUPPORTED_SCHEMA",
                2,
                Some(9),
                "schema_version <n> is newer than <n>"
            ),
            (
                "dead_letter",
                "TRANSIENT",
                1,
                None,
                "statement timeout after <n> ms"
            ),
        ]
    );
    let oldest: Vec<i64> = c
        .query(
            "SELECT dlq_id FROM dlq_messages WHERE error_class = 'PERMANENT' AND status = 'OPEN'
             ORDER BY first_seen",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(groups[0].samples, oldest, "the oldest first");

    // The command prints the same groups as JSON.
    let out = common::command(&env, &["dlq", "groups", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let printed = printed.as_array().unwrap();
    assert_eq!(printed.len(), 3);
    assert_eq!(printed[0]["fingerprint"], groups[0].fingerprint.as_str());
    assert_eq!(printed[0]["count"], 3);
    drop(c);
    env.cleanup().await;
}

/// Records `m` as an OPEN dead letter of `group` the way the intake does (its properties,
/// tags and keys as the broker carried them), first seen `age_secs` ago.
pub(super) async fn dead_letter(
    c: &tokio_postgres::Client,
    group: &str,
    m: &seckill::mq::OutMessage,
    offset: i64,
    error: &str,
    age_secs: f64,
) {
    let mut props: serde_json::Map<String, serde_json::Value> = m
        .properties
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    props.insert("TAGS".into(), m.tag.clone().into());
    props.insert("KEYS".into(), m.keys.join(" ").into());
    let message_id = props["message_id"].as_str().map(str::to_string);
    let reservation_id = props["reservation_id"].as_str().map(str::to_string);
    c.execute(
        "INSERT INTO dlq_messages (consumer_group, topic, message_id, reservation_id,
                                   dlq_queue_id, dlq_queue_offset, attempts, error_class,
                                   last_error, payload, properties, first_seen)
         VALUES ($1, $2, $3, $4, 0, $5, 17, 'transient', $6, $7, $8,
                 now() - make_interval(secs => $9))",
        &[
            &group,
            &m.topic,
            &message_id,
            &reservation_id,
            &offset,
            &error,
            &m.body,
            &serde_json::Value::Object(props),
            &age_secs,
        ],
    )
    .await
    .unwrap();
}

/// Projection dead letters for the users of `users` (each at the offset of its user id), all
/// failing with `error`, first seen a second ago.
async fn projection_dead_letters(
    c: &tokio_postgres::Client,
    names: &seckill::mq::Names,
    users: std::ops::Range<i64>,
    error: &str,
) {
    for user in users {
        let m = order_create_message(&names.order_event_topic, &event(1710, 1, user, 300));
        dead_letter(c, &names.projection_group, &m, user, error, 1.0).await;
    }
}

/// The batch ids the audit holds for `action`, with how many rows each.
async fn batches(c: &tokio_postgres::Client, action: &str) -> Vec<(String, i64)> {
    c.query(
        "SELECT replay_batch_id, count(*) FROM dlq_audit WHERE action = $1
         GROUP BY replay_batch_id ORDER BY min(audit_id)",
        &[&action],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// A failure group is replayed sample first under one batch id: with no consumer the sample is not
/// seen applied and the rest is held back; with one, the rest follows. A group can also be
/// discarded whole.
///
/// One story: the second replay takes the three dead letters the first one held back, and the
/// discard and the last count read what the replays left open.
#[tokio::test]
async fn a_group_of_dead_letters_is_replayed_sample_first_under_one_batch_id_or_discarded_whole() {
    let env = TestEnv::with_topics().await;
    env.activity(1710, 1, 10).await;
    let names = env.names();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    // Five order-create messages that died the same way (a lock timeout naming each order),
    // oldest first; and two of the projection that died another way.
    let events: Vec<_> = (1..=5).map(|u| event(1710, 1, u, 300)).collect();
    for (i, e) in events.iter().enumerate() {
        let m = order_create_message(&names.order_create_topic, e);
        let error = format!("canceling statement due to lock timeout on {}", e.order_id);
        dead_letter(
            &c,
            &names.order_create_group,
            &m,
            i as i64,
            &error,
            60.0 - i as f64,
        )
        .await;
    }
    projection_dead_letters(&c, &names, 10..12, "projection script error 7").await;
    let groups = seckill::roles::ops::dlq::failure_groups(&c, None, 1000)
        .await
        .unwrap();
    let fingerprint = |group: &str| {
        groups
            .iter()
            .find(|g| g.consumer_group == group)
            .unwrap()
            .fingerprint
            .clone()
    };
    let (orders_fp, projection_fp) = (
        fingerprint(&names.order_create_group),
        fingerprint(&names.projection_group),
    );
    let replay = |fp: String, verify: &'static str| {
        let env = &env;
        async move {
            common::cli_async(
                env,
                &[
                    "dlq",
                    "replay",
                    "--fingerprint",
                    &fp,
                    "--sample",
                    "2",
                    "--reason",
                    "lock fixed",
                    "--actor",
                    "tester",
                    "--verify-secs",
                    verify,
                    "--rate",
                    "200",
                ],
            )
            .await
        }
    };

    // No consumer runs: the sample is sent but never seen applied, so the rest is held back
    // and the command fails saying so.
    let out = replay(orders_fp.clone(), "2").await;
    assert!(!out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("2 not observed") && stdout.contains("3 held back"),
        "{stdout}"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        5,
        "3 order-create dead letters and the 2 of the projection still open"
    );
    let first = batches(&c, "REPLAY").await;
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].1, 2, "one batch id on the sample's two audit rows");
    assert!(first[0].0.starts_with("rpb_"));

    // With the consumer running, the next replay of the group (the three still open) applies
    // its sample, then the rest, under a batch id of its own.
    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let out = replay(orders_fp, "30").await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("3 confirmed (3 applied") && stdout.contains("0 held back"),
        "{stdout}"
    );
    let both = batches(&c, "REPLAY").await;
    assert_eq!(both.len(), 2);
    assert_eq!(both[1].1, 3);
    assert_ne!(both[0].0, both[1].0);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE replay_batch_id = '{}' AND effect = 'APPLIED:CREATED'",
            both[1].0
        ))
        .await,
        3
    );
    // The first sample's messages were on the topic all along: the consumer made them too.
    eventually(30, "five orders", || async {
        env.count("SELECT count(*) FROM orders").await == 5
    })
    .await;

    // The projection's group has no inbox to watch: judged by its sends, recorded as such.
    let out = replay(projection_fp.clone(), "2").await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE effect = 'UNOBSERVABLE'")
            .await,
        2
    );

    // Discarding a whole group: every open member, one batch id, each audited.
    projection_dead_letters(&c, &names, 20..23, "projection script error 9").await;
    let out = common::cli(
        &env,
        &[
            "dlq",
            "discard",
            "--fingerprint",
            &projection_fp,
            "--reason",
            "stale views",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let discards = batches(&c, "DISCARD").await;
    assert_eq!(discards.len(), 1);
    assert_eq!(discards[0].1, 3);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        0
    );
    let out = common::cli(
        &env,
        &[
            "dlq",
            "discard",
            "--fingerprint",
            "000000000000",
            "--reason",
            "x",
        ],
    );
    assert!(!out.status.success(), "an unknown fingerprint is an error");
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

/// The consume role exports each of the ten largest open groups of failures by fingerprint
/// (`mq_dlq_group_messages`), the rest summed under `fingerprint="other"`: one series per cause,
/// however many ways things fail.
#[tokio::test]
async fn the_consume_role_exports_the_largest_failure_groups_and_sums_the_rest() {
    let env = TestEnv::with_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    // One group of three, and eleven groups of one (eleven error classes).
    c.batch_execute(
        r#"INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                     error_class, last_error, payload, status, first_seen)
           SELECT 'CG_G', 't', 0, i, 17, 'BIG', 'lock timeout on ord_' || i, '{}', 'OPEN',
                  now() - interval '1 hour'
           FROM generate_series(1, 3) i;
           INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                     error_class, last_error, payload, status, first_seen)
           SELECT 'CG_G', 't', 0, 100 + i, 17, 'C' || i, 'failed', '{}', 'OPEN',
                  now() - make_interval(mins => 50 - i)
           FROM generate_series(1, 11) i;"#,
    )
    .await
    .unwrap();
    let groups = seckill::roles::ops::dlq::failure_groups(&c, Some("CG_G"), 1000)
        .await
        .unwrap();
    assert_eq!(groups.len(), 12);
    let big = &groups[0];
    assert_eq!(big.count, 3);
    let consume = common::Role::consume(1).spawn(&env);
    common::ready([&consume]).await;
    let series = |fp: &str, n: usize| {
        format!(
            "mq_dlq_group_messages{{fingerprint=\"{fp}\",consumer_group=\"CG_G\",source=\"dead_letter\"}} {n}"
        )
    };
    let (big_line, other_line) = (series(&big.fingerprint, 3), series("other", 2));
    common::assert_metrics(
        &format!("http://127.0.0.1:{}/metrics", consume.ops),
        &[big_line.as_str(), other_line.as_str()],
    )
    .await;
    let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", consume.ops))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let exported = text
        .lines()
        .filter(|l| l.starts_with("mq_dlq_group_messages{"))
        .count();
    assert_eq!(exported, 11, "ten groups and other:\n{text}");
    let mut consume = consume.proc;
    assert!(consume.terminate(40).await.success());
    drop(c);
    env.cleanup().await;
}
