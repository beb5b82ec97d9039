//! `redis.mode = "cluster"` on a real six-node Redis Cluster (`scripts/redis-cluster-up.sh`,
//! started by `make services-up`): every script runs on the primary that owns its activity,
//! gathered pipelines that span activities are split per slot, scans go to the slot's
//! primary, and a whole sale through the roles sells out exactly
//! (docs/architecture/redis.md#redis-cluster).

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use crate::common::{eventually, reserve_only, TestEnv};
use chrono::Utc;
use futures::StreamExt;
use seckill::domain::events::OrderEventHeader;
use seckill::redis::{Keys, Release, SentMark};

/// Which of the three primaries serves `slot` (the ranges `redis-cli --cluster create` gives).
fn primary_of(slot: u16) -> u8 {
    match slot {
        0..=5460 => 0,
        5461..=10922 => 1,
        _ => 2,
    }
}

/// Activity ids from `from` on, one on each of the three primaries.
fn one_activity_per_primary(keys: &Keys, from: i64) -> Vec<i64> {
    let mut seen = BTreeSet::new();
    let mut picked = Vec::new();
    for a in from.. {
        if seen.insert(primary_of(keys.slot(a))) {
            picked.push(a);
        }
        if picked.len() == 3 {
            break;
        }
    }
    picked
}

/// On Redis Cluster every script and gathered pipeline finds its slot: marks, releases, projections
/// and retirement over activities on three primaries answer in the callers' order.
///
/// One story: each gathered call acts on the six reservations the calls before it left, spread over
/// the same three primaries.
#[tokio::test]
async fn every_script_and_gathered_pipeline_finds_its_slot_on_the_cluster() {
    let env = TestEnv::without_topics().await.on_redis_cluster();
    let redis = env.redis().await;
    let activities = one_activity_per_primary(&redis.keys, 7300);
    for &a in &activities {
        env.activity(a, 1, 5).await;
    }
    // Two reservations per activity, interleaved, so every gathered call spans three slots
    // on three nodes.
    let mut reserved = Vec::new();
    for user in 1..=2 {
        for &a in &activities {
            reserved.push((a, reserve_only(&redis, a, user, 600_000).await));
        }
    }
    let now = Utc::now().timestamp_millis();
    let marks: Vec<SentMark> = reserved
        .iter()
        .map(|(a, ids)| SentMark {
            activity_id: *a,
            reservation_id: ids.reservation_id.clone(),
            message_id: ids.message_id.clone(),
            broker_msg_id: format!("b-{}", ids.message_id),
            sent_at_ms: now,
        })
        .collect();
    assert_eq!(
        redis.sends().mark_sent_many(&marks).await.unwrap(),
        vec!["OK"; 6]
    );
    // Answers come back in the callers' order: a second mark of each finds it MQ_SENT.
    assert_eq!(
        redis.sends().mark_sent_many(&marks).await.unwrap(),
        vec!["MQ_SENT"; 6]
    );
    for &a in &activities {
        assert_eq!(
            redis.recovery().pending_count(a).await.unwrap(),
            0,
            "activity {a}"
        );
        // The census scans the activity's keys on the primary that holds them.
        let census = redis.stock().reservation_census(a, 1).await.unwrap();
        assert_eq!(census.reserved_ids.len(), 2, "activity {a}: {census:?}");
    }
    // Give back the first reservation of each activity, gathered.
    let releases: Vec<Release<'_>> = reserved[..3]
        .iter()
        .map(|(a, ids)| Release {
            activity_id: *a,
            sku_id: 1,
            reservation_id: &ids.reservation_id,
            reason: "test",
        })
        .collect();
    assert_eq!(
        redis.sends().release_many(&releases, now).await.unwrap(),
        vec!["RELEASED"; 3]
    );
    assert_eq!(
        redis.sends().release_many(&releases, now).await.unwrap(),
        vec!["ALREADY_RELEASED"; 3]
    );
    for &a in &activities {
        assert_eq!(
            redis.stock().sku_stock(a, 1).await.unwrap(),
            Some((5, 4)),
            "{a}"
        );
    }
    // The projection of each reservation lives under its activity's tag; one gathered call
    // updates all six, and a lookup by reservation id alone finds each.
    let headers: Vec<OrderEventHeader> = reserved
        .iter()
        .map(|(_, ids)| OrderEventHeader {
            order_id: ids.order_id.clone(),
            reservation_id: ids.reservation_id.clone(),
            status: "CREATED".into(),
            aggregate_version: 1,
            user_id: 1,
        })
        .collect();
    let refs: Vec<&OrderEventHeader> = headers.iter().collect();
    assert_eq!(
        redis
            .projections()
            .project_many(&refs, 600, now, false)
            .await
            .unwrap(),
        vec!["APPLIED"; 6]
    );
    for (_, ids) in &reserved {
        let p = redis
            .projections()
            .projection(&ids.reservation_id)
            .await
            .unwrap();
        assert_eq!(p.get("order_id"), Some(&ids.order_id));
    }
    // Retiring an activity reaches every one of its keys, on its own node.
    for &a in &activities {
        // meta, sku, buyers, req: the keys with no expiry of their own.
        assert!(
            redis.recovery().retire_activity(a, 60).await.unwrap() >= 4,
            "{a}"
        );
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_sale_over_three_primaries_sells_out_exactly_through_the_roles() {
    const STOCK: i32 = 40;
    let env = TestEnv::with_topics().await.on_redis_cluster();
    let redis = env.redis().await;
    let activities = one_activity_per_primary(&redis.keys, 7400);
    for &a in &activities {
        env.activity(a, 1, STOCK).await;
    }
    let roles = common::SaleRoles::start(&env).await;
    let api_port = roles.api_port;
    // 100 buyers per activity for 40 units each, 16 at a time, every buyer on all three.
    let base = format!("http://127.0.0.1:{api_port}");
    let requests: Vec<(i64, i64)> = (1..=100)
        .flat_map(|user| activities.iter().map(move |&a| (a, user)))
        .collect();
    let answers: Vec<(i64, i64, u16, serde_json::Value)> = futures::stream::iter(requests)
        .map(|(a, user)| {
            let base = base.clone();
            async move {
                let (status, body) = common::reserve_as(&base, a, 1, user, "r1").await;
                (a, user, status.as_u16(), body)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for &a in &activities {
        let accepted: Vec<&serde_json::Value> = answers
            .iter()
            .filter(|(x, _, status, _)| *x == a && *status == 202)
            .map(|(_, _, _, body)| body)
            .collect();
        assert_eq!(accepted.len(), STOCK as usize, "activity {a}");
        // Every accepted reservation id names its activity.
        for body in accepted {
            let id = body["reservation_id"].as_str().unwrap();
            assert_eq!(
                seckill::domain::ids::reservation_activity(id),
                Some(a),
                "{id}"
            );
        }
        let sold_out = answers
            .iter()
            .filter(|(x, _, status, _)| *x == a && *status == 410)
            .count();
        assert_eq!(sold_out, 100 - STOCK as usize, "activity {a}");
    }
    for &a in &activities {
        eventually(120, "every reservation recorded as an order", || async {
            let r = env.invariants(a, 1).await;
            r.ok() && r.figures.unrecorded == 0 && r.figures.valid_orders == i64::from(STOCK)
        })
        .await;
        let r = env.invariants(a, 1).await;
        assert!(r.ok(), "activity {a}: {:?}", r.violations);
    }
    // A buyer finds their reservation by its id alone, through the projection on its node.
    let (_, user, _, body) = answers.iter().find(|(_, _, s, _)| *s == 202).unwrap();
    let (user, id) = (*user, body["reservation_id"].as_str().unwrap());
    eventually(30, "the reservation answered by id", || async {
        let r = reqwest::Client::new()
            .get(format!("{base}/v1/reservations/{id}"))
            .header("authorization", common::bearer(user))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        matches!(r, Ok(r) if r.status() == 200)
    })
    .await;
    roles.stop().await;
    env.cleanup().await;
}
