//! `seckill budget` against the fleet it describes
//! (docs/architecture/order-creation.md#connection-budget): each running role says on /metrics that
//! it may open exactly its printed share (`pg_pool_capacity`), and PostgreSQL, watched through a
//! sale by each connection's `application_name` (`seckill-<role>@<env>`), never sees a role hold
//! more.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;

use crate::common::{
    self, eventually, free_port, gauge, spawn, spawn_listening, wait_ready, TestEnv,
};

/// The most connections each role of `env` held at once, sampled until `stop`.
async fn watch_connections(
    pool: deadpool_postgres::Pool,
    env_name: String,
    stop: tokio_util::sync::CancellationToken,
) -> HashMap<String, i64> {
    let client = pool.get().await.unwrap();
    let pattern = format!("seckill-%@{env_name}~s%");
    let mut most: HashMap<String, i64> = HashMap::new();
    while !stop.is_cancelled() {
        for row in client
            .query(
                "SELECT application_name, count(*) FROM pg_stat_activity
                 WHERE application_name LIKE $1 GROUP BY 1",
                &[&pattern],
            )
            .await
            .unwrap()
        {
            let name: String = row.get(0);
            let role = name
                .trim_start_matches("seckill-")
                .split('@')
                .next()
                .unwrap();
            let n: i64 = row.get(1);
            let m = most.entry(role.to_string()).or_default();
            *m = (*m).max(n);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    most
}

/// Each running role's pool holds what `seckill budget` prints for it, and PostgreSQL never sees
/// more of its connections during a sale.
///
/// One story: the printout is read from the configuration the running roles use, and the watched
/// sale checks those same roles against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_fleet_opens_what_the_budget_prints_and_never_more() {
    let env = TestEnv::with_topics().await;
    env.activity(970, 1, 300).await;
    let (api_port, api_ops) = (free_port(), free_port());
    let mut api = spawn(
        &env,
        &["api"],
        "",
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{api_port}")),
            (
                "SECKILL__API__METRICS_LISTEN",
                format!("127.0.0.1:{api_ops}"),
            ),
        ],
    );
    let (mut consume, consume_port) =
        spawn_listening(&env, &["consume"], "SECKILL__CONSUMER__METRICS_LISTEN", &[]);
    let (mut scan, scan_port) =
        spawn_listening(&env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
    let (mut cancel, cancel_port) = spawn_listening(
        &env,
        &["timeout-cancel"],
        "SECKILL__TIMEOUT__METRICS_LISTEN",
        &[],
    );
    for port in [api_port, consume_port, scan_port, cancel_port] {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }
    // The printout, from the same configuration.
    let out = common::cli_async(&env, &["budget", "--json"]).await;
    assert!(out.status.success());
    let budget: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let share: HashMap<String, i64> = budget["roles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let role = r["role"].as_str().unwrap().to_string();
            (role, r["per_instance"].as_i64().unwrap())
        })
        .collect();
    let ports = [
        ("api", api_ops),
        ("consume", consume_port),
        ("scan", scan_port),
        ("timeout-cancel", cancel_port),
    ];
    for (role, port) in ports {
        eventually(20, &format!("{role}'s pools on /metrics"), || async move {
            gauge(port, "pg_pool_capacity").await.is_some()
        })
        .await;
        assert_eq!(
            gauge(port, "pg_pool_capacity").await,
            Some(share[role] as f64),
            "{role}: what it may open is what `seckill budget` prints"
        );
    }

    // A sale, 32 buyers at a time, with PostgreSQL watched throughout.
    let stop = tokio_util::sync::CancellationToken::new();
    let watching = tokio::spawn(watch_connections(
        env.pool(1).await,
        env.settings.env.clone(),
        stop.clone(),
    ));
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/970/skus/1/reservations");
    let accepted = futures::stream::iter(1..=600_i64)
        .map(|user| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let r = client
                    .post(url)
                    .header("authorization", common::bearer(user))
                    .json(&serde_json::json!({"user_id": user, "request_id": format!("u{user}"), "quantity": 1}))
                    .send()
                    .await;
                matches!(r, Ok(r) if r.status() == reqwest::StatusCode::ACCEPTED)
            }
        })
        .buffer_unordered(32)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await;
    assert_eq!(accepted, 300);
    eventually(90, "300 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 300
    })
    .await;
    stop.cancel();
    let most = watching.await.unwrap();
    eprintln!("connections held at most, by role: {most:?}; printed shares: {share:?}");
    for (role, _) in ports {
        let seen = most.get(role).copied().unwrap_or(0);
        assert!(seen > 0, "{role}: PostgreSQL saw none of its connections");
        assert!(
            seen <= share[role],
            "{role}: PostgreSQL saw {seen} connections, the budget prints {}",
            share[role]
        );
    }
    for p in [&mut api, &mut consume, &mut scan, &mut cancel] {
        assert!(p.terminate(40).await.success());
    }
    env.cleanup().await;
}
