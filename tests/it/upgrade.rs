//! Upgrades across versions (docs/architecture/postgresql.md#upgrades), against the real broker:
//! the consumer reads ORDER_CREATE_REQUESTED v1 and v2 side by side, producers switch with
//! `mq.order_event_schema`, and a v2 message that a consumer of an earlier release quarantined (it
//! knew v1 only) is replayed, audited, once the consumer reads v2.

use crate::common;

use std::sync::Arc;

use crate::common::{bearer, eventually, reserve_only, start_api, TestEnv};
use seckill::roles::consume::order_create::OrderCreateHandler;

/// A reservation through the API naming the buyer's sales channel (`None`: none).
async fn reserve_through(base: &str, activity: i64, user: i64, channel: Option<&str>) {
    let mut body =
        serde_json::json!({"user_id": user, "request_id": format!("req-{user}"), "quantity": 1});
    if let Some(c) = channel {
        body["channel"] = c.into();
    }
    let r = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/1/reservations"
        ))
        .header("authorization", bearer(user))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
}

/// A v1 backlog and the v2 messages sent after the switch become orders through one consumer, each
/// with what its schema carries. A re-send of a v1-era reservation carries its channel in v2.
///
/// One story: the v1 messages wait as a backlog while the v2 ones join them, and one consumer then
/// reads both, so the order of the switch is what is tested.
#[tokio::test]
async fn a_v1_backlog_then_v2_messages_become_orders_each_with_what_its_schema_carries() {
    let mut env = TestEnv::with_topics().await;
    env.activity(970, 1, 20).await;

    // Before the switch (v1, what every release reads): the request's channel is kept on the
    // reservation but not in the message. No consumer runs yet: the messages wait as a backlog.
    env.settings.mq.order_event_schema = 1;
    let api = start_api(env.settings.clone()).await;
    for user in 1..=4 {
        reserve_through(&api.base, 970, user, Some("app")).await;
    }
    api.stop.cancel();
    let _ = api.server.await;
    // After the switch, once every consumer reads v2: the channel travels in the message.
    env.settings.mq.order_event_schema = 2;
    let api = start_api(env.settings.clone()).await;
    for user in 5..=8 {
        reserve_through(&api.base, 970, user, Some("web")).await;
    }
    reserve_through(&api.base, 970, 9, None).await;
    // A channel that is not one is a clear 400, and nothing is reserved.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/activities/970/skus/1/reservations", api.base))
        .header("authorization", bearer(10))
        .json(&serde_json::json!({"user_id": 10, "request_id": "req-10", "quantity": 1, "channel": "<script>"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "INVALID_REQUEST", "{body}");

    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    eventually(
        60,
        "nine orders from the v1 backlog and the v2 messages",
        || async {
            env.count("SELECT count(*) FROM orders WHERE activity_id = 970")
                .await
                == 9
        },
    )
    .await;
    // v1 carried no channel; v2 carried the buyer's, or none when the request named none.
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE channel IS NULL AND user_id <= 4")
            .await,
        4
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE channel = 'web' AND user_id BETWEEN 5 AND 8")
            .await,
        4
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE channel IS NULL AND user_id = 9")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM quarantined_messages").await,
        0
    );
    // The v1-era reservation kept its channel: a re-send after the switch carries it in v2.
    let redis = env.redis().await;
    let rid: String = env
        .pool(1)
        .await
        .get()
        .await
        .unwrap()
        .query_one("SELECT reservation_id FROM orders WHERE user_id = 1", &[])
        .await
        .unwrap()
        .get(0);
    let fields = redis.reservation(970, &rid).await.unwrap();
    let resend = seckill::roles::scan::event_from_reservation(&fields, 2).unwrap();
    assert_eq!(
        (resend.schema_version, resend.channel.as_deref()),
        (2, Some("app"))
    );
    let report = env.invariants(970, 1).await;
    assert!(report.ok(), "{report:?}");
    api.stop.cancel();
    let _ = api.server.await;
    consumer.shutdown().await;
    env.cleanup().await;
}

/// A v2 message that a consumer of the earlier release quarantined is replayed once the consumer
/// reads v2: one order, audited. A second replay is a no-op, and a body nobody can read is refused.
///
/// One story: the replays act on the rows the old consumer's quarantine wrote, and the second
/// replay and the final report read what the first replay left.
#[tokio::test]
async fn a_v2_message_quarantined_by_a_v1_consumer_is_replayed_once_and_audited() {
    let env = TestEnv::with_topics().await;
    env.activity(971, 1, 5).await;
    let names = env.names();
    let redis = env.redis().await;
    let ids = reserve_only(&redis, 971, 31, 600_000).await;
    let fields = redis.reservation(971, &ids.reservation_id).await.unwrap();
    let mut event = seckill::roles::scan::event_from_reservation(&fields, 2).unwrap();
    event.channel = Some("mini_program".into());

    // What a consumer of the earlier release did with it: quarantined, raw body and the
    // message's properties kept, the message acknowledged.
    let msg = seckill::mq::order_create_message(&names.order_create_topic, &event);
    let mut delivery = common::delivery_of(&names.order_create_topic, &event);
    delivery.properties.extend(msg.properties.iter().cloned());
    delivery.properties.insert("TAGS", msg.tag.clone());
    delivery.properties.insert("KEYS", msg.keys.join(" "));
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    seckill::pg::quarantine(
        &**c,
        &names.order_create_group,
        &delivery,
        "UNSUPPORTED_SCHEMA",
        "UNSUPPORTED_SCHEMA: schema_version 2",
    )
    .await
    .unwrap();
    // A body nobody can read, quarantined beside it.
    let garbage = common::delivery(
        &names.order_create_topic,
        Some("evt_garbage"),
        b"{\"schema_version\": 2, \"trunc".to_vec(),
    );
    seckill::pg::quarantine(
        &**c,
        &names.order_create_group,
        &garbage,
        "INVALID_JSON",
        "eof",
    )
    .await
    .unwrap();
    let report = env.invariants(971, 1).await;
    assert_eq!(report.figures.quarantined, 2, "{report:?}");

    // The consumer now reads v2.
    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let out = common::cli_async(&env, &["dlq", "list", "--quarantined", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    let schema_row = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["reason"] == "UNSUPPORTED_SCHEMA")
        .unwrap();
    assert_eq!(schema_row["message_id"], event.message_id.as_str());
    let qid = schema_row["quarantine_id"].as_i64().unwrap().to_string();
    let garbage_id = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["reason"] == "INVALID_JSON")
        .unwrap()["quarantine_id"]
        .as_i64()
        .unwrap()
        .to_string();

    // The pre-checks: the schema is known now, the reservation is still held.
    let out = common::cli_async(
        &env,
        &[
            "dlq",
            "replay",
            "--quarantined",
            "--id",
            &qid,
            "--dry-run",
            "--json",
        ],
    )
    .await;
    let checks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(checks[0]["schema_known"], true, "{checks}");
    assert_eq!(checks[0]["reservation"], "RESERVED", "{checks}");

    // By reason and group, as an operator after a rollout would: only the schema one goes.
    let group = names.order_create_group.clone();
    let out = common::cli_async(
        &env,
        &[
            "dlq",
            "replay",
            "--quarantined",
            "--quarantine-reason",
            "UNSUPPORTED_SCHEMA",
            "--group",
            &group,
            "--reason",
            "consumers read v2 now",
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
        env.count("SELECT count(*) FROM orders WHERE channel = 'mini_program'")
            .await
            == 1
    })
    .await;
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE quarantine_id = {qid} AND dlq_id IS NULL
             AND action = 'REPLAY' AND outcome = 'CONFIRMED' AND actor = 'tester'
             AND effect = 'APPLIED:CREATED'"
        ))
        .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM quarantined_messages WHERE status = 'REPLAYED'")
            .await,
        1
    );

    // Replayed again by id: the inbox makes it a no-op. The garbage is refused without
    // --force (its schema cannot be read), and the command says so by failing.
    let out = common::cli_async(
        &env,
        &[
            "dlq",
            "replay",
            "--quarantined",
            "--id",
            &qid,
            "--reason",
            "again",
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
    let out = common::cli_async(
        &env,
        &[
            "dlq",
            "replay",
            "--quarantined",
            "--id",
            &garbage_id,
            "--reason",
            "try",
        ],
    )
    .await;
    assert!(!out.status.success());
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE quarantine_id = {qid} AND effect = 'DUPLICATE'"
        ))
        .await,
        1
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE quarantine_id = {garbage_id}
             AND outcome = 'REFUSED_SCHEMA_UNKNOWN'"
        ))
        .await,
        1
    );
    let report = env.invariants(971, 1).await;
    assert!(report.ok(), "{report:?}");
    assert_eq!(report.figures.quarantined, 1, "only the garbage is left");
    consumer.shutdown().await;
    env.cleanup().await;
}
