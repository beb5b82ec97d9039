//! When Redis forgets writes it acknowledged (docs/architecture/redis.md#when-redis-forgets): the
//! API finds Redis behind what it answered and fences the activity, the scanner rebuilds the
//! activity from PostgreSQL once the backlog has drained, and buyers are answered as before the
//! loss; `seckill activity resync` does the same on an operator's word. The loss here is written by
//! hand (the state as it was before the last reservations); the fault test that loses the last
//! second of a real Redis's writes is in `redis_loss_faults`.

use std::collections::HashMap;

use deadpool_redis::redis::AsyncCommands;
use serde_json::Value;

use crate::common::{self, cli, eventually, reserve_as, Proc, Role, TestEnv};

/// Redis as it was before these reservations `(user, reservation_id, request_id)` of one SKU:
/// their buyers, request ids and hashes gone, their units back, the sequence back by as many
/// (`rewind_seq`: an operator's drift has no sequence to go back).
pub async fn forget(
    env: &TestEnv,
    activity: i64,
    sku: i64,
    gone: &[(i64, String, String)],
    rewind_seq: bool,
) {
    let redis = env.redis().await;
    let k = &redis.keys;
    let mut conn = redis.pool.get().await.unwrap();
    for (user, rid, request) in gone {
        let _: () = conn.hdel(k.buyers(activity, sku), user).await.unwrap();
        let _: () = conn
            .hdel(k.requests(activity), format!("{user}:{request}"))
            .await
            .unwrap();
        let _: () = conn.del(k.reservation(activity, rid)).await.unwrap();
    }
    let n = gone.len() as i64;
    let _: () = conn
        .hincr(k.sku(activity, sku), "remaining", n)
        .await
        .unwrap();
    if rewind_seq {
        let _: () = conn.hincr(k.meta(activity), "seq", -n).await.unwrap();
    }
}

/// The error code of a JSON error body.
fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

/// The roles of a sale in which Redis forgets.
pub(crate) struct Roles {
    api: Proc,
    /// The API's base URL.
    pub(crate) base: String,
    /// The API's ops port (`/metrics`).
    ops: u16,
    scan: Proc,
    consume: Proc,
}

/// api (with its ops port), `consume` and `scan` with `failpoints`, `scan` polling for fences every
/// 200 ms and resuming through a `ramp_secs` ramp.
pub(crate) async fn start(env: &TestEnv, ramp_secs: u64, failpoints: &str) -> Roles {
    start_with(env, ramp_secs, failpoints, &[]).await
}

/// [`start`], with `consume` also given `consume_env`.
pub(crate) async fn start_with(
    env: &TestEnv,
    ramp_secs: u64,
    failpoints: &str,
    consume_env: &[(&'static str, String)],
) -> Roles {
    let api = Role::api().spawn(env);
    let scan = Role::scan()
        .failpoints(failpoints)
        .var("SECKILL__SCAN__RESYNC_POLL_MS", 200)
        .var("SECKILL__API__RESUME_RAMP_SECS", ramp_secs)
        .spawn(env);
    let consume = Role::consume(2)
        .failpoints(failpoints)
        .vars(consume_env)
        .spawn(env);
    common::ready([&api, &scan, &consume]).await;
    Roles {
        base: api.base(),
        ops: api.ops,
        api: api.proc,
        scan: scan.proc,
        consume: consume.proc,
    }
}

impl Roles {
    pub(crate) async fn stop(mut self) {
        let _ = self.api.terminate(20).await;
        let _ = self.scan.terminate(20).await;
        let _ = self.consume.terminate(40).await;
    }
}

/// Users `users` reserve SKU 1 of `activity` (request id `r<user>`), each answered 202;
/// their reservation ids, once PostgreSQL holds all their orders.
async fn reserved(
    env: &TestEnv,
    base: &str,
    activity: i64,
    users: std::ops::RangeInclusive<i64>,
) -> HashMap<i64, String> {
    let mut ids = HashMap::new();
    for u in users.clone() {
        let (status, body) = reserve_as(base, activity, 1, u, &format!("r{u}")).await;
        assert_eq!(status, 202, "buyer {u}: {body}");
        ids.insert(u, body["reservation_id"].as_str().unwrap().to_string());
    }
    let want = ids.len() as i64;
    let sql = format!("SELECT count(*) FROM orders WHERE activity_id = {activity}");
    eventually(60, "every reservation an order", || async {
        env.count(&sql).await == want
    })
    .await;
    ids
}

/// Redis behind what the API already answered fences the activity: new reservations and forgotten
/// retries are refused until the scanner rebuilds from PostgreSQL. The sale then resumes through
/// its ramp, with no second reservation.
///
/// One story: the forgotten reservations make the fence, the rebuild restores them, and the retries
/// after it must find the reservations made before the loss.
#[tokio::test]
async fn redis_behind_what_it_answered_fences_the_activity_until_rebuilt_from_postgresql() {
    let env = TestEnv::with_topics().await;
    env.activity(501, 1, 20).await;
    let roles = start(&env, 10, "").await;
    let ids = reserved(&env, &roles.base, 501, 1..=6).await;

    // Redis forgets the last three reservations, its sequence with them.
    let gone: Vec<(i64, String, String)> = (4..=6)
        .map(|u| (u, ids[&u].clone(), format!("r{u}")))
        .collect();
    forget(&env, 501, 1, &gone, true).await;

    // The next reservation finds Redis behind what this API saw: refused, and so is a retry
    // whose request id Redis no longer knows (it would otherwise get a second reservation).
    let (status, body) = reserve_as(&roles.base, 501, 1, 7, "r7").await;
    assert_eq!(
        (status.as_u16(), code(&body)),
        (503, "SALE_PAUSED"),
        "{body}"
    );
    let (status, body) = reserve_as(&roles.base, 501, 1, 5, "r5").await;
    assert_eq!(
        (status.as_u16(), code(&body)),
        (503, "SALE_PAUSED"),
        "{body}"
    );
    // The fault bit: a fence recorded from the sequence, by the API.
    let fences = "SELECT count(*) FROM redis_fences WHERE activity_id = 501 \
                  AND signal = 'sequence' AND detected_by LIKE 'api@%'";
    assert_eq!(env.count(fences).await, 1);

    // The scanner rebuilds once the backlog drained, and the sale resumes through its ramp:
    // buyer 5's retry answers its first reservation, never a second one.
    let mut ramped = 0;
    let mut answer = None;
    for _ in 0..600 {
        let (status, body) = reserve_as(&roles.base, 501, 1, 5, "r5").await;
        if status == 202 {
            answer = Some(body);
            break;
        }
        assert_eq!(code(&body), "SALE_PAUSED", "{body}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let body = answer.expect("resumed within 60 s");
    assert_eq!(body["reservation_id"].as_str(), Some(ids[&5].as_str()));
    assert_eq!(body["duplicate"], true);
    // Buyer 6 with a new request id already holds an order: not a second 202.
    let (status, body) = reserve_as(&roles.base, 501, 1, 6, "another").await;
    assert_eq!(code(&body), "ALREADY_PURCHASED", "{status} {body}");
    // A new buyer is admitted through the ramp (the first arrivals of a ramp wait).
    for _ in 0..300 {
        let (status, body) = reserve_as(&roles.base, 501, 1, 7, "r7").await;
        if status == 202 {
            break;
        }
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("resuming"),
            "{body}"
        );
        ramped += 1;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(ramped > 0, "the first arrival of a ramp waits");
    let closed = "SELECT count(*) FROM redis_fences WHERE activity_id = 501 \
                  AND resumed_at IS NOT NULL AND (rebuild->'diff'->>'requests_restored')::int = 3";
    eventually(10, "the fence closed with its rebuild", || async {
        env.count(closed).await == 1
    })
    .await;
    let sql = "SELECT count(*) FROM orders WHERE activity_id = 501";
    eventually(30, "buyer 7's order", || async {
        env.count(sql).await == 7
    })
    .await;
    let report = env.invariants(501, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    let metrics = reqwest::get(format!("http://127.0.0.1:{}/metrics", roles.ops))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("redis_loss_detected_total{signal=\"sequence\"} 1"),
        "{metrics}"
    );
    roles.stop().await;
    env.cleanup().await;
}

/// `seckill activity resync` reports the drift first, and its dry run writes nothing. It then
/// rebuilds the activity from PostgreSQL, records a fence and audits both runs; a second look finds
/// nothing to change.
///
/// One story: the dry run and the rebuild read the same drift made at the start, and the second
/// look checks what the rebuild left.
#[tokio::test]
async fn activity_resync_reports_first_then_rebuilds_and_audits() {
    let env = TestEnv::with_topics().await;
    env.activity(502, 1, 10).await;
    let roles = start(&env, 0, "").await;
    let ids = reserved(&env, &roles.base, 502, 1..=3).await;
    // Drift an operator might find: buyer 3 and its unit forgotten, no sequence to show it.
    forget(&env, 502, 1, &[(3, ids[&3].clone(), "r3".into())], false).await;
    let redis = env.redis().await;
    let remaining = || async {
        let mut c = redis.pool.get().await.unwrap();
        let v: i64 = c.hget(redis.keys.sku(502, 1), "remaining").await.unwrap();
        v
    };
    assert_eq!(remaining().await, 8);

    let dry = cli(
        &env,
        &[
            "activity",
            "resync",
            "--activity-id",
            "502",
            "--dry-run",
            "--json",
        ],
    );
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let report: Value = serde_json::from_slice(&dry.stdout).unwrap();
    let r = &report["rebuilt"];
    assert_eq!(r["written"], false);
    assert_eq!(r["changes"], true);
    assert_eq!(r["diff"]["requests_restored"], 1);
    assert_eq!(r["diff"]["skus"][0]["remaining_before"], 8);
    assert_eq!(r["diff"]["skus"][0]["remaining_after"], 7);
    assert_eq!(r["diff"]["skus"][0]["buyers_restored"], 1);
    assert_eq!(remaining().await, 8, "a dry run writes nothing");

    let run = cli(
        &env,
        &[
            "activity",
            "resync",
            "--activity-id",
            "502",
            "--json",
            "--reason",
            "drift",
        ],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(remaining().await, 7);
    let mut c = redis.pool.get().await.unwrap();
    let holder: Option<String> = c.hget(redis.keys.buyers(502, 1), 3).await.unwrap();
    assert_eq!(holder.as_deref(), Some(ids[&3].as_str()));
    let status: Option<String> = c
        .hget(redis.keys.reservation(502, &ids[&3]), "status")
        .await
        .unwrap();
    assert_eq!(status.as_deref(), Some("RESERVED"));
    let (st, body) = reserve_as(&roles.base, 502, 1, 3, "r3").await;
    assert_eq!(
        (st.as_u16(), body["reservation_id"].as_str()),
        (202, Some(ids[&3].as_str()))
    );

    // Recorded and audited; a second look finds nothing to change.
    let fence =
        "SELECT count(*) FROM redis_fences WHERE activity_id = 502 AND signal = 'operator' \
                 AND detail = 'drift' AND resumed_at IS NOT NULL";
    assert_eq!(env.count(fence).await, 1);
    let audit = "SELECT count(*) FROM admin_audit WHERE target = 'activity:502' \
                 AND action IN ('activity_resync_dry_run', 'activity_resync')";
    assert_eq!(env.count(audit).await, 2);
    let again = cli(
        &env,
        &[
            "activity",
            "resync",
            "--activity-id",
            "502",
            "--dry-run",
            "--json",
        ],
    );
    let report: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["rebuilt"]["changes"], false, "{report}");
    let inv = env.invariants(502, 1).await;
    assert!(inv.ok(), "{:?}", inv.violations);
    roles.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_compensation_for_a_forgotten_reservation_warns_and_fences_once() {
    use seckill::domain::events::{OrderRef, ReleaseReservation};
    use seckill::roles::consume::compensate::CompensationHandler;
    let env = TestEnv::without_topics().await;
    env.activity(503, 1, 5).await;
    let redis = env.redis().await;
    let ids = common::reserve_only(&redis, 503, 9, 60_000).await;
    // Redis forgets the reservation; then its order is cancelled and the release arrives,
    // twice (a redelivery).
    let mut c = redis.pool.get().await.unwrap();
    let _: () = c
        .del(redis.keys.reservation(503, &ids.reservation_id))
        .await
        .unwrap();
    let release = ReleaseReservation::new(
        &OrderRef {
            order_id: ids.order_id.clone(),
            reservation_id: ids.reservation_id.clone(),
            activity_id: 503,
            sku_id: 1,
            user_id: 9,
        },
        "ORDER_CANCELED",
    );
    let body = serde_json::to_vec(&release).unwrap();
    let handler = CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(2).await,
        group: env.names().compensate_group,
    };
    let topic = env.names().compensate_topic;
    for _ in 0..2 {
        let d = common::delivery(&topic, None, body.clone());
        assert_eq!(handler.process(&[d]).await.unwrap(), ["missing"]);
    }
    // No unit given back from nothing; one fence, from the consumer's signal; the shard
    // refuses reservations until the rebuild.
    assert_eq!(redis.stock().sku_stock(503, 1).await.unwrap(), Some((5, 4)));
    let fences = "SELECT count(*) FROM redis_fences WHERE activity_id = 503 \
                  AND signal = 'compensation_missing' AND detected_by LIKE 'consume@%'";
    assert_eq!(env.count(fences).await, 1);
    let (_, r) = common::try_reserve(&redis, 503, 10, "x", 60_000).await;
    assert!(
        matches!(r, seckill::redis::ReserveResult::Fenced { .. }),
        "{r:?}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_rebuild_holds_what_moves_stock_until_it_writes_the_shard() {
    const ACTIVITY: i64 = 1391;
    let env = TestEnv::without_topics().await;
    env.activity(ACTIVITY, 1, 5).await;
    let redis = env.redis().await;
    let ids = common::reserve_only(&redis, ACTIVITY, 7, 60_000).await;
    let remaining = || async {
        let mut c = redis.pool.get().await.unwrap();
        let n: i64 = c
            .hget(redis.keys.sku(ACTIVITY, 1), "remaining")
            .await
            .unwrap();
        n
    };
    assert_eq!(remaining().await, 4);
    let release = [seckill::redis::Release {
        activity_id: ACTIVITY,
        sku_id: 1,
        reservation_id: &ids.reservation_id,
        reason: "TIMEOUT",
    }];
    let shards = redis.shards(ACTIVITY).await.unwrap();

    // Held: the release waits, then says so, and moves nothing.
    redis
        .rebuild()
        .hold_stock(&shards, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let held = redis.sends().release_many(&release, 0).await;
    assert!(
        matches!(held, Err(seckill::redis::StoreError::Held(_))),
        "{held:?}"
    );
    assert_eq!(remaining().await, 4, "nothing given back while held");

    // The rebuild writes the shard: the hold is gone with it, and the release gives the unit
    // back once.
    let resync = seckill::services::resync::Resync {
        settings: std::sync::Arc::new(env.settings.clone()),
        pg: env.pool(2).await,
        redis: redis.clone(),
        probe: None,
        by: "test".into(),
    };
    let rebuilt = resync.rebuild(ACTIVITY, true).await.unwrap();
    assert_eq!(rebuilt.attempts, 1);
    let again = redis.sends().release_many(&release, 0).await.unwrap();
    assert_eq!(again, vec!["RELEASED".to_string()]);
    assert_eq!(remaining().await, 5);
    env.cleanup().await;
}
