//! Sale passes (docs/architecture/hot-path.md#sale-passes), against real PostgreSQL, Redis and the
//! broker: registration before the sale within the limit and the window, one pass per buyer;
//! a sale that requires passes refuses a request without one, a forged one, another buyer's,
//! and a pass that already holds a reservation; a proof of work, when asked, binds to its
//! buyer; a rebuilt Redis still requires passes and still knows which are used.

use std::collections::BTreeMap;

use chrono::Utc;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::common::{self, cli_async, eventually, spawn_consume, TestEnv};

/// `POST` `path` of the API as buyer `user` (no token when `None`) with `body`.
async fn post(base: &str, path: &str, user: Option<i64>, body: Value) -> (u16, Value) {
    let mut r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body);
    if let Some(u) = user {
        r = r.header("authorization", common::bearer(u));
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A reservation as `user` carrying `pass` in `Sale-Pass` (none when `None`).
async fn reserve_with(
    base: &str,
    (activity, sku): (i64, i64),
    user: i64,
    request_id: &str,
    pass: Option<&str>,
) -> (u16, Value) {
    let mut r = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/{sku}/reservations"
        ))
        .header("authorization", common::bearer(user))
        .json(&json!({"request_id": request_id, "quantity": 1}));
    if let Some(p) = pass {
        r = r.header("sale-pass", p);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn code(body: &Value) -> &str {
    common::error_code(body).unwrap_or("")
}

/// Creates `activity` with SKUs 1 and 2 (10 each) by the CLI, starting in `starts_in_ms`,
/// selling to at most `passes` pass holders, with `extra` arguments.
async fn create(env: &TestEnv, activity: i64, starts_in_ms: i64, passes: u32, extra: &[&str]) {
    let starts = (Utc::now() + chrono::Duration::milliseconds(starts_in_ms)).to_rfc3339();
    let (id, passes) = (activity.to_string(), passes.to_string());
    let mut args = vec![
        "activity",
        "create",
        "--activity-id",
        &id,
        "--sku",
        "1:10",
        "--sku",
        "2:10",
        "--starts-at",
        &starts,
        "--passes",
        &passes,
    ];
    args.extend_from_slice(extra);
    let out = cli_async(env, &args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Twelve buyers register for five passes and five get one. Once the sale starts only a holder
/// buys, once; a forged, borrowed or altered pass buys nothing. Redis rebuilt from PostgreSQL keeps
/// what the passes bought.
///
/// One story: the purchases use the passes the registration issued, and the rebuild must give back
/// the pass state those purchases wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sale_with_passes_sells_once_to_each_registered_buyer_and_to_nobody_else() {
    let env = TestEnv::with_topics().await;
    let activity = 9301;
    create(&env, activity, 6_000, 5, &[]).await;
    let api = common::start_api(env.settings.clone()).await;
    let path = format!("/v1/activities/{activity}/passes");

    // Twelve buyers register at once for five passes: exactly five are issued.
    let answers: Vec<(i64, u16, Value)> = futures::stream::iter(1..=12i64)
        .map(|b| {
            let (base, path) = (api.base.clone(), path.clone());
            async move {
                let (s, body) = post(&base, &path, Some(b), json!({})).await;
                (b, s, body)
            }
        })
        .buffer_unordered(12)
        .collect()
        .await;
    let passes: BTreeMap<i64, String> = answers
        .iter()
        .filter(|(_, s, _)| *s == 201)
        .map(|(b, _, body)| (*b, body["pass"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(passes.len(), 5, "{answers:?}");
    for (b, s, body) in &answers {
        if !passes.contains_key(b) {
            assert_eq!((*s, code(body)), (410, "PASSES_EXHAUSTED"), "{b}: {body}");
        }
    }
    assert_eq!(
        env.count(&format!(
            "SELECT passes_issued::bigint FROM activities WHERE activity_id = {activity}"
        ))
        .await,
        5
    );
    assert_eq!(env.count("SELECT count(*) FROM sale_passes").await, 5);
    // Registering again answers the pass held (200), not a second one.
    let (&first, first_pass) = passes.iter().next().unwrap();
    let (s, body) = post(&api.base, &path, Some(first), json!({})).await;
    assert_eq!((s, body["pass"].as_str()), (200, Some(first_pass.as_str())));
    // No token, or a body naming someone else: nothing issued.
    let (s, body) = post(&api.base, &path, None, json!({"user_id": 77})).await;
    assert_eq!((s, code(&body)), (401, "UNAUTHENTICATED"));
    let (s, body) = post(&api.base, &path, Some(78), json!({"user_id": 77})).await;
    assert_eq!((s, code(&body)), (403, "FORBIDDEN"));

    // Before the sale, a request without a pass is refused already.
    let (s, body) = reserve_with(&api.base, (activity, 1), 90, "early", None).await;
    assert_eq!((s, code(&body)), (403, "PASS_REQUIRED"), "{body}");
    // The sale starts; registration closes with it.
    eventually(15, "registration closed at the start", || async {
        let (s, body) = post(&api.base, &path, Some(91), json!({})).await;
        (s, code(&body)) == (403, "REGISTRATION_CLOSED")
    })
    .await;

    let holders: Vec<i64> = passes.keys().copied().collect();
    let (a, b) = (holders[0], holders[1]);
    let outsider = (1..=12).find(|u| !passes.contains_key(u)).unwrap();
    // Without a pass, with a made-up one, with another buyer's, with a genuine one altered.
    let (s, body) = reserve_with(&api.base, (activity, 1), outsider, "o1", None).await;
    assert_eq!((s, code(&body)), (403, "PASS_REQUIRED"), "{body}");
    let forged = format!("sp1.{activity}.{outsider}.sp_{}.AAAA", ulid::Ulid::new());
    let (s, body) = reserve_with(&api.base, (activity, 1), outsider, "o2", Some(&forged)).await;
    assert_eq!((s, code(&body)), (403, "PASS_INVALID"), "{body}");
    let (s, body) = reserve_with(&api.base, (activity, 1), outsider, "o3", Some(&passes[&a])).await;
    assert_eq!((s, code(&body)), (403, "PASS_INVALID"), "{body}");
    let altered = passes[&a].replacen(&format!(".{a}."), &format!(".{outsider}."), 1);
    let (s, body) = reserve_with(&api.base, (activity, 1), outsider, "o4", Some(&altered)).await;
    assert_eq!((s, code(&body)), (403, "PASS_INVALID"), "{body}");

    // A holder buys once; the same request again is the same reservation; the pass does not
    // buy the other SKU.
    let (s, first) = reserve_with(&api.base, (activity, 1), a, "a1", Some(&passes[&a])).await;
    assert_eq!(s, 202, "{first}");
    let (s, again) = reserve_with(&api.base, (activity, 1), a, "a1", Some(&passes[&a])).await;
    assert_eq!(
        (s, &again["reservation_id"]),
        (202, &first["reservation_id"])
    );
    let (s, body) = reserve_with(&api.base, (activity, 2), a, "a2", Some(&passes[&a])).await;
    assert_eq!((s, code(&body)), (409, "PASS_USED"), "{body}");
    let (s, body) = reserve_with(&api.base, (activity, 2), b, "b2", Some(&passes[&b])).await;
    assert_eq!(s, 202, "{body}");

    // Redis forgets the activity's pass state; the rebuild from PostgreSQL restores it.
    let (mut consume, _) = spawn_consume(&env, "2", "");
    eventually(60, "the two orders", || async {
        env.count("SELECT count(*) FROM orders").await == 2
    })
    .await;
    let redis = env.redis().await;
    {
        let mut c = redis.pool.get().await.unwrap();
        let _: () = deadpool_redis::redis::cmd("HDEL")
            .arg(redis.keys.meta(activity))
            .arg("passes")
            .query_async(&mut *c)
            .await
            .unwrap();
        let _: () = deadpool_redis::redis::cmd("DEL")
            .arg(redis.keys.passes_used(activity))
            .query_async(&mut *c)
            .await
            .unwrap();
    }
    let id = activity.to_string();
    let args = [
        "activity",
        "resync",
        "--activity-id",
        &id,
        "--reason",
        "test",
    ];
    let out = cli_async(&env, &args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A fresh instance asks Redis, not what it cached.
    let fresh = common::start_api(env.settings.clone()).await;
    let (s, body) = reserve_with(&fresh.base, (activity, 2), outsider, "o5", None).await;
    assert_eq!((s, code(&body)), (403, "PASS_REQUIRED"), "{body}");
    let (s, body) = reserve_with(&fresh.base, (activity, 2), a, "a3", Some(&passes[&a])).await;
    assert_eq!((s, code(&body)), (409, "PASS_USED"), "{body}");

    for sku in [1, 2] {
        let report = env.invariants(activity, sku).await;
        assert!(report.ok(), "SKU {sku}: {:?}", report.violations);
    }
    assert!(consume.terminate(40).await.success());
    api.stop.cancel();
    fresh.stop.cancel();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registration_asks_a_proof_of_work_bound_to_its_buyer() {
    let env = TestEnv::without_topics().await;
    let activity = 9302;
    let opens = (Utc::now() - chrono::Duration::seconds(5)).to_rfc3339();
    create(
        &env,
        activity,
        60_000,
        10,
        &[
            "--pass-pow-difficulty",
            "400",
            "--pass-registration-opens-at",
            &opens,
        ],
    )
    .await;
    let api = common::start_api(env.settings.clone()).await;
    let path = format!("/v1/activities/{activity}/passes");
    let (s, body) = post(&api.base, &path, Some(1), json!({})).await;
    assert_eq!((s, code(&body)), (403, "POW_REQUIRED"), "{body}");
    // Buyer 1's challenge, solved the way a client would.
    let (s, c) = post(&api.base, &format!("{path}/challenges"), Some(1), json!({})).await;
    assert_eq!(s, 200, "{c}");
    assert!(c["difficulty"].as_u64().unwrap() >= 400, "{c}");
    let challenge: altcha::Challenge = serde_json::from_value(c["challenge"].clone()).unwrap();
    let solved = seckill::auth::pow::solve(&challenge).expect("solvable");
    let pow = serde_json::to_value(&solved).unwrap();
    // Buyer 2 cannot register with buyer 1's work, nor buyer 1 with a counter found cheaper.
    let (s, body) = post(&api.base, &path, Some(2), json!({"pow": pow})).await;
    assert_eq!((s, code(&body)), (403, "POW_INVALID"), "{body}");
    let mut cheap = pow.clone();
    cheap["solution"]["counter"] = json!(1);
    cheap["solution"]["derivedKey"] = json!("00".repeat(32));
    let (s, body) = post(&api.base, &path, Some(1), json!({"pow": cheap})).await;
    assert_eq!((s, code(&body)), (403, "POW_INVALID"), "{body}");
    let (s, body) = post(&api.base, &path, Some(1), json!({"pow": "nonsense"})).await;
    assert_eq!((s, code(&body)), (400, "INVALID_REQUEST"), "{body}");
    let (s, body) = post(&api.base, &path, Some(1), json!({"pow": {"counter": 1}})).await;
    assert_eq!((s, code(&body)), (403, "POW_INVALID"), "{body}");
    let (s, body) = post(&api.base, &path, Some(1), json!({"pow": pow})).await;
    assert_eq!(s, 201, "{body}");
    assert_eq!(env.count("SELECT count(*) FROM sale_passes").await, 1);
    // An activity without passes has no registration.
    env.activity(9303, 1, 5).await;
    let (s, body) = post(&api.base, "/v1/activities/9303/passes", Some(1), json!({})).await;
    assert_eq!((s, code(&body)), (409, "PASSES_NOT_REQUIRED"), "{body}");
    let (s, body) = post(&api.base, "/v1/activities/9399/passes", Some(1), json!({})).await;
    assert_eq!((s, code(&body)), (404, "ACTIVITY_NOT_FOUND"), "{body}");
    // The policy is in the activity's audit trail.
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM admin_audit WHERE action = 'passes_set' \
             AND target = 'activity:{activity}' AND detail->>'pow_difficulty' = '400'"
        ))
        .await,
        1
    );
    api.stop.cancel();
    env.cleanup().await;
}
