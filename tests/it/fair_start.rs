//! A fair start (docs/architecture/hot-path.md#a-fair-start), against real Redis (and Redis
//! Cluster), the broker and PostgreSQL: the requests of an activity's fair window enter a draw, are
//! held until it closes, and the stock goes to the entrants in the order the activity's seed gives
//! them, whatever order they came in; a buyer who went away while held still gets the reservation
//! the draw gave them.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;

use crate::common::{self, eventually, reserve_as, spawn_consume, spawn_listening, TestEnv};

/// The buyers whose tickets come first for `seed`: what the draw must give the stock to
/// (`ticket = the first 13 hex digits of sha1("<seed>:<buyer>")`, computed by Redis itself).
async fn expected_winners(seed: &str, buyers: &[i64], stock: usize) -> BTreeSet<i64> {
    let redis = deadpool_redis::redis::Client::open(common::plain_redis_url()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    let mut tickets = Vec::new();
    for &b in buyers {
        let hex: String = deadpool_redis::redis::cmd("EVAL")
            .arg("return redis.sha1hex(ARGV[1])")
            .arg(0)
            .arg(format!("{seed}:{b}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        tickets.push((
            u64::from_str_radix(&hex[..13], 16).unwrap(),
            b.to_string(),
            b,
        ));
    }
    tickets.sort();
    tickets.into_iter().take(stock).map(|(_, _, b)| b).collect()
}

/// The scenario the plain Redis and the cluster tests run: a fair window's stock goes to the buyers
/// in seed order, a winner who left while held keeps the reservation, and the draw is audited and
/// exported.
///
/// One story: the draw is made over the requests this window held, and the orders, the audit row
/// and the figures all come from that one draw.
async fn a_fair_window_draws_the_stock_in_seed_order(env: TestEnv, activity: i64) {
    let (stock, seed) = (4, format!("seed-{activity}"));
    env.activity(activity, 1, stock).await;
    // The activity started a second ago: its window closes 2.5 s from now.
    env.redis()
        .await
        .draws()
        .set_fair_start(activity, 3_500, &seed)
        .await
        .unwrap();
    let buyers: Vec<i64> = (1..=12).collect();
    let winners = expected_winners(&seed, &buyers, stock as usize).await;
    let api = common::start_api(env.settings.clone()).await;
    let (mut scan, scan_port) =
        spawn_listening(&env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
    let (mut consume, _) = spawn_consume(&env, "2", "");
    // One winner goes away while held (its client gives up after 300 ms).
    let leaver = *winners.iter().next().unwrap();
    let gone = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
        .post(format!(
            "{}/v1/activities/{activity}/skus/1/reservations",
            api.base
        ))
        .header("authorization", common::bearer(leaver))
        .json(&serde_json::json!({"request_id": "r-leaver", "quantity": 1}))
        .send()
        .await;
    assert!(gone.is_err(), "the leaver's client gave up while held");
    // The others, all at once, in an order that is not the tickets'.
    let answers: Vec<(i64, u16, serde_json::Value)> = futures::stream::iter(buyers.iter().rev())
        .filter(|b| futures::future::ready(**b != leaver))
        .map(|&b| {
            let base = api.base.clone();
            async move {
                let (status, body) = reserve_as(&base, activity, 1, b, &format!("r-{b}")).await;
                (b, status.as_u16(), body)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let won: BTreeSet<i64> = answers
        .iter()
        .filter(|(_, status, _)| *status == 202)
        .map(|(b, ..)| *b)
        .collect();
    let mut want = winners.clone();
    want.remove(&leaver);
    assert_eq!(won, want, "202s go to the first tickets: {answers:?}");
    for (b, status, body) in &answers {
        if !winners.contains(b) {
            assert_eq!(*status, 410, "{b}: {body}");
            assert_eq!(common::error_code(body), Some("SOLD_OUT"));
        }
    }
    // The leaver asks again with the same request: the reservation the draw gave them.
    let (status, body) = reserve_as(&api.base, activity, 1, leaver, "r-leaver").await;
    assert_eq!(status.as_u16(), 202, "{body}");
    // Every winner's order is made, the leaver's sent by the scanner.
    eventually(60, "an order per winner", || async {
        env.count("SELECT count(*) FROM orders").await == stock as i64
    })
    .await;
    let ordered: BTreeSet<i64> = {
        let pool = env.pool(1).await;
        let c = pool.get().await.unwrap();
        c.query("SELECT user_id FROM orders", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(ordered, winners);
    // The scanner recorded the draw in the activity's audit trail.
    let target = format!("activity:{activity}");
    eventually(30, "the draw in the audit trail", || {
        let (target, seed) = (target.clone(), seed.clone());
        let env = &env;
        async move {
            env.count(&format!(
                "SELECT count(*) FROM admin_audit WHERE action = 'fair_draw' AND target = '{target}' \
                 AND detail->>'entrants' = '12' AND detail->>'won' = '4' AND detail->>'lost' = '8' \
                 AND detail->>'seed' = '{seed}'"
            ))
            .await
                == 1
        }
    })
    .await;
    // The draw's size and outcome per activity on the scanner's /metrics.
    let text = reqwest::get(format!("http://127.0.0.1:{scan_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (name, value) in [
        ("fair_draw_entrants", 12),
        ("fair_draw_won", 4),
        ("fair_draw_lost", 8),
    ] {
        let want = format!("{name}{{activity_id=\"{activity}\",sku_id=\"1\"}} {value}");
        assert!(text.lines().any(|l| l == want), "{want} not in:\n{text}");
    }
    // After the window, first come first served: nothing left to take.
    let (status, _) = reserve_as(&api.base, activity, 1, 99, "r-late").await;
    assert_eq!(status.as_u16(), 410);
    let report = common::sold_out_converged(&env, stock, activity).await;
    assert!(report.ok(), "{:?}", report.violations);
    assert!(consume.terminate(40).await.success());
    assert!(scan.terminate(20).await.success());
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fair_window_draws_the_stock_in_seed_order_and_a_buyer_who_left_keeps_theirs() {
    a_fair_window_draws_the_stock_in_seed_order(TestEnv::with_topics().await, 975).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_draw_is_the_same_on_redis_cluster() {
    a_fair_window_draws_the_stock_in_seed_order(
        TestEnv::with_topics().await.on_redis_cluster(),
        976,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draw_nobody_waits_for_is_made_by_the_scanner() {
    let env = TestEnv::with_topics().await;
    env.activity(977, 1, 2).await;
    env.redis()
        .await
        .draws()
        .set_fair_start(977, 2_000, "seed-977")
        .await
        .unwrap();
    let api = common::start_api(env.settings.clone()).await;
    // The only entrant gives up while held; no request comes after it.
    let gone = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
        .post(format!(
            "{}/v1/activities/977/skus/1/reservations",
            api.base
        ))
        .header("authorization", common::bearer(7))
        .json(&serde_json::json!({"request_id": "r-7", "quantity": 1}))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up while held");
    api.stop.cancel();
    let (mut scan, _) = spawn_listening(&env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
    let (mut consume, _) = spawn_consume(&env, "2", "");
    eventually(
        60,
        "the scanner drew the SKU and sent the winner",
        || async {
            env.count("SELECT count(*) FROM orders WHERE user_id = 7")
                .await
                == 1
        },
    )
    .await;
    let report = env.invariants(977, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    eventually(30, "the draw in the audit trail", || async {
        env.count(
            "SELECT count(*) FROM admin_audit WHERE action = 'fair_draw' \
             AND target = 'activity:977' AND detail->>'won' = '1'",
        )
        .await
            == 1
    })
    .await;
    assert!(consume.terminate(40).await.success());
    assert!(scan.terminate(20).await.success());
    env.cleanup().await;
}

/// An API killed while its requests wait for the draw loses none of their answers: the scanner
/// draws and sends the winners, and a new instance answers each buyer's same request.
///
/// One story: the requests are held in the draw when the API dies, and the new instance answers
/// from what that draw decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_killed_while_its_requests_wait_for_the_draw_loses_none_of_their_answers() {
    let env = TestEnv::with_topics().await;
    let (stock, seed) = (3, "seed-978");
    let created = chrono::Utc::now();
    env.activity(978, 1, stock).await;
    let buyers: Vec<i64> = (1..=8).collect();
    let winners = expected_winners(seed, &buyers, stock as usize).await;
    let start_api = || {
        let port = common::free_port();
        let p = common::spawn(
            &env,
            &["api"],
            "",
            &[
                ("SECKILL__API__LISTEN", format!("127.0.0.1:{port}")),
                (
                    "SECKILL__API__METRICS_LISTEN",
                    format!("127.0.0.1:{}", common::free_port()),
                ),
            ],
        );
        (p, format!("http://127.0.0.1:{port}"))
    };
    let (mut api, base) = start_api();
    common::wait_ready(format!("{base}/readyz")).await;
    let (mut scan, _) = spawn_listening(&env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
    let (mut consume, _) = spawn_consume(&env, "2", "");
    // The window (from the start, a second before `created`) closes 2.5 s from now, however
    // long the roles took to start.
    let window = (chrono::Utc::now() - created).num_milliseconds() as u64 + 1_000 + 2_500;
    env.redis()
        .await
        .draws()
        .set_fair_start(978, window, seed)
        .await
        .unwrap();
    // Every buyer enters and is held; the API is killed while they wait.
    let waiting: Vec<_> = buyers
        .iter()
        .map(|&b| {
            let base = base.clone();
            // Its answer never comes: the connection dies with the API.
            tokio::spawn(async move {
                reqwest::Client::new()
                    .post(format!("{base}/v1/activities/978/skus/1/reservations"))
                    .header("authorization", common::bearer(b))
                    .json(&serde_json::json!({"request_id": format!("r-{b}"), "quantity": 1}))
                    .send()
                    .await
                    .is_err()
            })
        })
        .collect();
    let redis = env.redis().await;
    for &b in &buyers {
        eventually(10, "every buyer in the draw", || {
            let (redis, id) = (&redis, format!("r-{b}"));
            async move {
                redis
                    .intake()
                    .request_reservation(978, b, &id)
                    .await
                    .unwrap()
                    .is_some()
            }
        })
        .await;
    }
    let _ = api.0.kill();
    let _ = api.0.wait();
    for w in waiting {
        assert!(
            w.await.unwrap(),
            "no held request was answered before the kill"
        );
    }
    // The scanner draws once the longest hold is over and sends the winners.
    eventually(60, "an order per winner", || async {
        env.count("SELECT count(*) FROM orders").await == stock as i64
    })
    .await;
    // A new API instance: each buyer asks again with the same request and gets its answer.
    let (mut api, base) = start_api();
    common::wait_ready(format!("{base}/readyz")).await;
    for &b in &buyers {
        let (status, body) = reserve_as(&base, 978, 1, b, &format!("r-{b}")).await;
        let want = if winners.contains(&b) { 202 } else { 410 };
        assert_eq!(status.as_u16(), want, "buyer {b}: {body}");
    }
    let report = common::sold_out_converged(&env, stock, 978).await;
    assert!(report.ok(), "{:?}", report.violations);
    for p in [&mut api, &mut consume, &mut scan] {
        assert!(p.terminate(40).await.success());
    }
    env.cleanup().await;
}
