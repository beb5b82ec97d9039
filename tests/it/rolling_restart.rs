//! Restarts are hand-offs (docs/architecture/roles.md#graceful-shutdown): an API told to stop turns
//! not ready and serves on for its drain delay before it closes, so HAProxy in front of two
//! instances (deploy/haproxy/seckill-api.cfg, as shipped) restarted one after the other during
//! a sale fails no buyer; the consumer and the scanner restarted mid-sale lose and double no
//! order.

use crate::common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{eventually, free_port, spawn, start_api, wait_ready, Proc, TestEnv};
use reqwest::StatusCode;
use serde_json::{json, Value};

#[tokio::test]
async fn a_stopping_api_turns_not_ready_then_serves_through_its_drain_delay() {
    let env = TestEnv::with_topics().await;
    env.activity(990, 1, 10).await;
    let mut settings = env.settings.clone();
    settings.api.drain_delay_ms = 2_000;
    let api = start_api(settings).await;
    let stopped = Instant::now();
    api.stop.cancel();
    // Not ready at once...
    let ready = reqwest::get(format!("{}/readyz", api.base)).await.unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    // ...while a new connection is still served (a balancer that has not noticed yet).
    let (s, b) = common::reserve_as(&api.base, 990, 1, 1, "during-drain").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    // Then the listener closes.
    let closed = tokio::time::timeout(Duration::from_secs(15), api.server)
        .await
        .expect("stopped within the grace");
    closed.unwrap().unwrap();
    let took = stopped.elapsed();
    eprintln!("not ready at once, served during the drain, closed after {took:?}");
    assert!(
        took >= Duration::from_millis(1_900),
        "closed after {took:?}"
    );
    assert!(reqwest::get(format!("{}/healthz", api.base)).await.is_err());
    env.cleanup().await;
}

/// `seckill api` on `port` (ops on a port of its own) with a drain delay.
fn api_instance(env: &TestEnv, port: u16) -> Proc {
    spawn(
        env,
        &["api"],
        "",
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{port}")),
            ("SECKILL__API__METRICS_LISTEN", "127.0.0.1:0".into()),
            ("SECKILL__API__DRAIN_DELAY_MS", "3000".into()),
        ],
    )
}

/// HAProxy with the shipped configuration, in the foreground, in front of `apis`, its
/// statistics on `stats`.
fn haproxy(bind: u16, stats: u16, apis: [u16; 2]) -> Proc {
    let cfg =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/haproxy/seckill-api.cfg");
    let child = std::process::Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(cfg)
        .env("SECKILL_LB_BIND", format!("127.0.0.1:{bind}"))
        .env("SECKILL_LB_STATS", format!("127.0.0.1:{stats}"))
        .env("SECKILL_API_1", format!("127.0.0.1:{}", apis[0]))
        .env("SECKILL_API_2", format!("127.0.0.1:{}", apis[1]))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("haproxy runs (make services-up installs it)");
    Proc(child, None)
}

/// HAProxy's counters for the API backend: retries, redispatches, connection errors and
/// response errors (`/stats;csv`: wretr, wredis, econ, eresp).
async fn backend_errors(stats: u16) -> (u64, u64, u64, u64) {
    let csv = reqwest::get(format!("http://127.0.0.1:{stats}/stats;csv"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let header: Vec<&str> = csv
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("# ")
        .split(',')
        .collect();
    let row: Vec<&str> = csv
        .lines()
        .find(|l| l.starts_with("seckill_api,BACKEND,"))
        .unwrap_or_else(|| panic!("no backend row in\n{csv}"))
        .split(',')
        .collect();
    let field = |name: &str| -> u64 {
        let i = header.iter().position(|h| *h == name).unwrap();
        row[i].parse().unwrap_or(0)
    };
    (
        field("wretr"),
        field("wredis"),
        field("econ"),
        field("eresp"),
    )
}

/// What the buyers saw: 202s with their reservation ids, and every other outcome.
#[derive(Default)]
struct Seen {
    accepted: HashSet<String>,
    failed: Vec<String>,
}

/// Each API behind HAProxy, then the consumer and the scanner, restarted in turn during a sale: no
/// buyer gets a failure, the balancer sends nothing again, and every accepted reservation becomes
/// exactly one order.
///
/// One story: the buyers go through the balancer for the whole of the restarts, and the end checks
/// compare the orders with the reservations those buyers were told were accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_instance_restarted_in_turn_behind_haproxy_fails_no_buyer_and_loses_no_order() {
    const BUYERS: usize = 8;
    let env = TestEnv::with_topics().await;
    env.activity(991, 1, 100_000).await;
    let ports = [free_port(), free_port()];
    let mut apis = [api_instance(&env, ports[0]), api_instance(&env, ports[1])];
    let (consume_port, scan_port) = (free_port(), free_port());
    let consume = |env: &TestEnv| {
        spawn(
            env,
            &["consume", "--workers", "2"],
            "",
            &[(
                "SECKILL__CONSUMER__METRICS_LISTEN",
                format!("127.0.0.1:{consume_port}"),
            )],
        )
    };
    let scan = |env: &TestEnv| {
        spawn(
            env,
            &["scan"],
            "",
            &[(
                "SECKILL__SCAN__METRICS_LISTEN",
                format!("127.0.0.1:{scan_port}"),
            )],
        )
    };
    let (mut consumer, mut scanner) = (consume(&env), scan(&env));
    for port in ports {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }
    wait_ready(format!("http://127.0.0.1:{consume_port}/readyz")).await;
    let (lb_port, stats_port) = (free_port(), free_port());
    let _lb = haproxy(lb_port, stats_port, ports);
    let lb = format!("http://127.0.0.1:{lb_port}");
    wait_ready(format!("{lb}/readyz")).await;

    // Buyers through the balancer until the restarts are over (each a new buyer, one request).
    let done = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let client = reqwest::Client::new();
    let mut buyers = Vec::new();
    for b in 0..BUYERS {
        let (done, seen, client, lb) = (done.clone(), seen.clone(), client.clone(), lb.clone());
        buyers.push(tokio::spawn(async move {
            // Bounded: at most 5,000 requests per buyer task.
            for i in 0..5_000i64 {
                if done.load(Ordering::SeqCst) {
                    break;
                }
                let user = 1 + b as i64 * 10_000 + i;
                let r = client
                    .post(format!("{lb}/v1/activities/991/skus/1/reservations"))
                    .header("authorization", common::bearer(user))
                    .json(&json!({"request_id": format!("r{user}"), "quantity": 1}))
                    .send()
                    .await;
                let outcome = match r {
                    Ok(r) if r.status() == StatusCode::ACCEPTED => {
                        let body: Value = r.json().await.unwrap_or(Value::Null);
                        body["reservation_id"]
                            .as_str()
                            .map(str::to_string)
                            .ok_or(body.to_string())
                    }
                    Ok(r) => Err(format!(
                        "{}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => Err(format!("no answer: {e}")),
                };
                {
                    let mut seen = seen.lock().unwrap();
                    match outcome {
                        Ok(rid) => {
                            seen.accepted.insert(rid);
                        }
                        Err(e) => seen.failed.push(e),
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    let accepted = || seen.lock().unwrap().accepted.len();
    eventually(10, "buyers served through the balancer", || async {
        accepted() > 50
    })
    .await;

    // Each API in turn: SIGTERM (it drains), start it again, wait until the balancer has it back.
    for (i, port) in ports.into_iter().enumerate() {
        let before = accepted();
        let status = apis[i].terminate(20).await;
        assert!(status.success(), "api {i} exit on SIGTERM: {status:?}");
        apis[i] = api_instance(&env, port);
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
        // Two good checks a second apart and it is back in rotation; the sale went on meanwhile.
        tokio::time::sleep(Duration::from_secs(3)).await;
        eprintln!(
            "api {i} restarted: {} reservations accepted meanwhile",
            accepted() - before
        );
    }
    // The consumer and the scanner, the same way.
    assert!(
        consumer.terminate(40).await.success(),
        "consumer exit on SIGTERM"
    );
    consumer = consume(&env);
    assert!(
        scanner.terminate(40).await.success(),
        "scanner exit on SIGTERM"
    );
    scanner = scan(&env);
    wait_ready(format!("http://127.0.0.1:{consume_port}/readyz")).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, Ordering::SeqCst);
    for b in buyers {
        b.await.unwrap();
    }
    let (accepted_ids, failed) = {
        let seen = seen.lock().unwrap();
        (seen.accepted.clone(), seen.failed.clone())
    };
    eprintln!(
        "through HAProxy while each API, the consumer and the scanner restarted: {} accepted, \
         {} failed",
        accepted_ids.len(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "buyers failed: {:?}",
        &failed[..failed.len().min(10)]
    );
    // Not even the balancer had to save a request: no connection refused or cut off, nothing
    // sent again (HAProxy retries a refused connection, which would hide a refusal from the
    // buyers; the drain delay is what keeps it from happening).
    let (retries, redispatches, conn_errors, resp_errors) = backend_errors(stats_port).await;
    eprintln!(
        "HAProxy backend: {retries} retries, {redispatches} redispatches, {conn_errors} \
         connection errors, {resp_errors} response errors"
    );
    assert_eq!(
        (retries, redispatches, conn_errors, resp_errors),
        (0, 0, 0, 0),
        "requests the balancer had to send again or failed on"
    );

    // Every accepted reservation is exactly one order; nothing else became one.
    let n = accepted_ids.len() as i64;
    eventually(90, "every accepted reservation an order", || async {
        env.count("SELECT count(*) FROM orders").await == n
    })
    .await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let rows = client
        .query("SELECT reservation_id FROM orders", &[])
        .await
        .unwrap();
    let ordered: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(ordered.len(), rows.len(), "no reservation ordered twice");
    assert_eq!(
        ordered, accepted_ids,
        "the orders are exactly the accepted reservations"
    );
    let report = seckill::invariants::check(
        &**client,
        &env.redis().await,
        &env.names().order_create_group,
        991,
        1,
    )
    .await
    .unwrap();
    assert!(report.ok(), "{:?}", report.violations);
    assert_eq!(report.figures.valid_orders, n);
    drop((consumer, scanner, apis));
    env.cleanup().await;
}
