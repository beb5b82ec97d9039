//! A sale through the real binaries (`api`, `consume`, `scan`) while something fails
//! (docs/architecture/invariants.md#failure-cases):
//! every consumer killed and restarted (runs in `make test`); the broker killed and restarted,
//! PostgreSQL restarted (these disturb services every other test shares, so they are ignored
//! by `make test` and run one at a time by `make test-faults`). The consumers are throttled
//! below the buyers' arrival rate, and each fault lands while reservations are still being
//! accepted and orders are still being created (a quarter of the stock accepted, some orders
//! but fewer than acceptances). Each test then shows its fault bit, by a counter the roles
//! export (redeliveries absorbed by the inbox, UNKNOWN sends and scanner re-sends, rolled-back
//! transactions), and ends with the pipeline converged and every invariant holding: no order
//! lost, doubled or oversold.

mod brokers;
mod redis_primary;

pub(crate) use redis_primary::{primary_and_replica, settled_primary_and_replica};

use crate::common;
use crate::common::metric;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    caught_up, eventually, free_port, spawn, wait_ready, Proc, Role, Started, TestEnv,
};
use futures::StreamExt;
use serde_json::json;

const STOCK: i32 = 300;
const BUYERS: i64 = 900;

/// The roles of one sale, each a real process.
pub(crate) struct Roles {
    pub(crate) api: Proc,
    pub(crate) api_port: u16,
    /// The API's ops port (`/metrics`).
    pub(crate) api_ops: u16,
    pub(crate) consumers: Vec<(Proc, u16)>,
    pub(crate) scan: Proc,
    pub(crate) scan_port: u16,
}

/// A consumer throttled below the buyers' arrival rate (batches of at most 4, each transaction
/// held 100 ms by a failpoint: at most about 80 orders/s), so an order backlog builds during
/// the sale.
/// The consumers' throttle: 100 ms inside each order transaction, so a backlog builds.
const THROTTLED: &str = "consume-inside-transaction=sleep(100)";
/// Transactions held 300 ms: a restart of PostgreSQL that lands while one is open cuts it.
const THROTTLED_LONG_TX: &str = "consume-inside-transaction=sleep(300)";
/// The same as [`THROTTLED`], and 2 s between each commit and its ACK: a consumer killed at any moment of the
/// sale is then almost surely holding a committed batch it never ACKed.
const THROTTLED_SLOW_ACK: &str =
    "consume-inside-transaction=sleep(100);consume-after-commit-before-ack=sleep(2000)";

fn start_consumer(env: &TestEnv, failpoints: &str) -> (Proc, u16) {
    let c = consumer(env, failpoints);
    (c.proc, c.ops)
}

fn consumer(env: &TestEnv, failpoints: &str) -> Started {
    Role::consume(2)
        .failpoints(failpoints)
        .var("SECKILL__CONSUMER__BATCH_SIZE", 4)
        .spawn(env)
}

pub(crate) async fn start_roles(env: &TestEnv, consumers: usize, first_consumers: &str) -> Roles {
    let api = Role::api().spawn(env);
    // Confirmed sends a dead broker holds go out again 3 s after the consumers' progress on
    // the live one (10 s by default).
    let scan = Role::scan()
        .var("SECKILL__SCAN__UNCONSUMED_RESEND_MS", 3000)
        .spawn(env);
    let consumers: Vec<Started> = (0..consumers)
        .map(|_| consumer(env, first_consumers))
        .collect();
    common::ready([&api, &scan].into_iter().chain(&consumers)).await;
    Roles {
        api: api.proc,
        api_port: api.port,
        api_ops: api.ops,
        consumers: consumers.into_iter().map(|c| (c.proc, c.ops)).collect(),
        scan: scan.proc,
        scan_port: scan.ops,
    }
}

/// Buyers 1..=BUYERS, 8 at a time; `fault` runs while the sale is in flight: a quarter of the
/// stock accepted, and PostgreSQL holding some orders but fewer than the acceptances (an order
/// backlog). Each buyer asks as [`buy`] does, and the answers are printed by status and code.
/// Returns how many buyers got a 202.
async fn sale_with<F, Fut>(env: &TestEnv, activity: i64, api_port: u16, fault: F) -> usize
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/{activity}/skus/1/reservations");
    let accepted = Arc::new(AtomicUsize::new(0));
    let answers = Arc::new(std::sync::Mutex::new(BTreeMap::<String, usize>::new()));
    let load = {
        let (accepted, answers) = (accepted.clone(), answers.clone());
        tokio::spawn(
            futures::stream::iter(1..=BUYERS).for_each_concurrent(8, move |user| {
                let (client, url) = (client.clone(), url.clone());
                let (accepted, answers) = (accepted.clone(), answers.clone());
                async move {
                    if buy(&client, &url, user, &answers).await {
                        accepted.fetch_add(1, Ordering::SeqCst);
                    }
                    // About 120 buyers/s: the stock sells over a few seconds, faster
                    // than the throttled consumers create orders.
                    tokio::time::sleep(Duration::from_millis(60)).await;
                }
            }),
        )
    };
    eventually(
        60,
        "a quarter of the stock accepted, with an order backlog",
        || async {
            let a = accepted.load(Ordering::SeqCst) as i64;
            let orders = env.count("SELECT count(*) FROM orders").await;
            a >= STOCK as i64 / 4 && orders > 0 && orders < a
        },
    )
    .await;
    let (at_accepted, at_orders) = (
        accepted.load(Ordering::SeqCst) as i64,
        env.count("SELECT count(*) FROM orders").await,
    );
    eprintln!("fault lands at {at_accepted} accepted, {at_orders} orders");
    assert!(
        at_accepted < STOCK as i64 && at_orders < at_accepted,
        "the fault must land mid-sale: {at_accepted} accepted, {at_orders} orders"
    );
    fault().await;
    load.await.unwrap();
    eprintln!("answers: {:?}", answers.lock().unwrap());
    accepted.load(Ordering::SeqCst)
}

/// One buyer's reservation, as a client that follows the API's contract: a 5xx or 429 answer
/// (a dependency down, a paused sale) or no answer at all loses nothing, so the buyer asks
/// again with the same `request_id`, a few times, half a second apart; the same request id
/// gets its reservation back if the first attempt took one. Every answer is tallied by
/// status and code. Whether it ended in 202.
pub(crate) async fn buy(
    client: &reqwest::Client,
    url: &str,
    user: i64,
    answers: &std::sync::Mutex<BTreeMap<String, usize>>,
) -> bool {
    for attempt in 0..5 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let r = client
            .post(url)
            .header("authorization", common::bearer(user))
            .json(&json!({"user_id": user, "request_id": format!("u{user}"), "quantity": 1}))
            .send()
            .await;
        let (answer, again) = match r {
            Ok(r) => {
                let status = r.status();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let code = body["error"]["code"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let again = status.is_server_error() || status.as_u16() == 429;
                (format!("{} {code}", status.as_u16()), again)
            }
            Err(e) => (
                format!(
                    "no answer ({})",
                    if e.is_timeout() { "timeout" } else { "error" }
                ),
                true,
            ),
        };
        let accepted = answer.starts_with("202");
        *answers.lock().unwrap().entry(answer).or_default() += 1;
        if accepted {
            return true;
        }
        if !again {
            return false;
        }
    }
    false
}

pub(crate) async fn finish(mut roles: Roles, env: TestEnv) {
    let _ = roles.api.terminate(20).await;
    let _ = roles.scan.terminate(20).await;
    for (c, _) in &mut roles.consumers {
        let _ = c.terminate(40).await;
    }
    env.cleanup().await;
}

fn sigkill(p: &mut Proc) {
    let _ = p.0.kill();
    let _ = p.0.wait();
}

#[tokio::test]
async fn every_consumer_killed_and_restarted_during_a_sale_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity(980, 1, STOCK).await;
    let mut roles = start_roles(&env, 2, THROTTLED_SLOW_ACK).await;
    let api_port = roles.api_port;
    let consumers = &mut roles.consumers;
    let env_ref = &env;
    let accepted = sale_with(&env, 980, api_port, move || async move {
        // Both consumers die holding committed batches they never ACKed (2 s between commit
        // and ACK), without a clean shutdown; two new ones take over their queues (rebalance)
        // and get those batches again.
        for (c, _) in consumers.iter_mut() {
            sigkill(c);
        }
        let fresh: Vec<(Proc, u16)> = (0..2).map(|_| start_consumer(env_ref, THROTTLED)).collect();
        for (_, port) in &fresh {
            wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
        }
        *consumers = fresh;
    })
    .await;
    assert!(accepted >= STOCK as usize, "accepted {accepted}");
    let report = common::sold_out_converged(&env, STOCK, 980).await;
    assert!(report.ok(), "{:?}", report.violations);
    // It bit: the killed consumers had committed orders whose messages they never ACKed; the
    // new ones got them again and the inbox absorbed them.
    let mut absorbed = 0.0;
    for (_, port) in &roles.consumers {
        absorbed += metric(*port, "mq_duplicate_message_total", "").await;
    }
    eprintln!("evidence: {absorbed} redeliveries absorbed by the inbox");
    assert!(
        absorbed > 0.0,
        "no redelivery reached the inbox: the kill bit nothing"
    );
    finish(roles, env).await;
}

/// SIGKILLs the server whose pid `scripts/rocketmq-up.sh` wrote to `pid_file`.
fn sigkill_server(pid_file: &str) {
    let pid = std::fs::read_to_string(run_dir().join(pid_file)).unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -KILL {pid}");
}

/// Where `scripts/rocketmq-up.sh` keeps its pid files.
pub(crate) fn run_dir() -> std::path::PathBuf {
    std::env::var("SECKILL_RUN_DIR")
        .map(Into::into)
        .unwrap_or_else(|_| Path::new(&std::env::var("HOME").unwrap()).join(".cache/seckill/run"))
}

fn script(name: &str) -> std::process::ExitStatus {
    script_with(name, &[], &[])
}

/// `scripts/<name> <args>` with `vars` set; its own output is dropped.
pub(crate) fn script_with(
    name: &str,
    args: &[&str],
    vars: &[(&str, &str)],
) -> std::process::ExitStatus {
    std::process::Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scripts")
            .join(name),
    )
    .args(args)
    .envs(vars.iter().copied())
    .stdout(std::process::Stdio::null())
    .status()
    .expect("script runs")
}

#[tokio::test]
#[ignore = "kills the shared broker: run by `make test-faults`, one test at a time"]
async fn the_broker_killed_and_restarted_mid_sale_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity(981, 1, STOCK).await;
    let roles = start_roles(&env, 1, THROTTLED).await;
    let accepted = sale_with(&env, 981, roles.api_port, || async {
        sigkill_server("broker.pid");
        // Reservations made meanwhile end UNKNOWN (kept, re-sent by the scanner) or refused.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(script("rocketmq-up.sh").success(), "broker restarted");
    })
    .await;
    assert!(accepted > 0);
    let report = common::sold_out_converged(&env, STOCK, 981).await;
    assert!(report.ok(), "{:?}", report.violations);
    // It bit: sends the API could not confirm while the broker was down, which the scanner
    // then re-sent and the broker confirmed.
    let unconfirmed = metric(roles.api_ops, "mq_publish_total", r#"outcome="unknown""#).await
        + metric(
            roles.api_ops,
            "mq_publish_total",
            r#"outcome="definite_failure""#,
        )
        .await;
    let resent = metric(
        roles.scan_port,
        "reservation_resend_total",
        r#"outcome="confirmed""#,
    )
    .await;
    eprintln!("evidence: {unconfirmed} sends unconfirmed, {resent} re-sends confirmed");
    assert!(
        unconfirmed > 0.0 && resent > 0.0,
        "the broker kill bit nothing: {unconfirmed} unconfirmed sends, {resent} re-sends confirmed"
    );
    finish(roles, env).await;
}

#[tokio::test]
#[ignore = "restarts the shared PostgreSQL: run by `make test-faults`, one test at a time"]
async fn postgresql_restarted_mid_sale_rolls_back_retries_and_loses_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity(982, 1, STOCK).await;
    let roles = start_roles(&env, 1, THROTTLED_LONG_TX).await;
    let accepted = sale_with(&env, 982, roles.api_port, || async {
        // Land it while an order transaction is open (the consumer holds each one 300 ms
        // after its statements): a restart between two transactions would only be seen as a
        // pooled connection quietly replaced.
        eventually(30, "an order transaction open", || async {
            env.count(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE state = 'idle in transaction' AND datname = current_database()",
            )
            .await
                > 0
        })
        .await;
        let version = std::fs::read_dir("/etc/postgresql")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .max_by_key(|v| v.parse::<u32>().unwrap_or(0))
            .unwrap();
        // Immediate: open transactions are cut, as in a crash; the consumers see transient
        // errors, roll back and retry on fresh connections.
        let restarted = std::process::Command::new("pg_ctlcluster")
            .args([
                "--skip-systemctl-redirect",
                &version,
                "main",
                "restart",
                "-m",
                "immediate",
            ])
            .status()
            .unwrap();
        assert!(restarted.success(), "PostgreSQL restarted");
    })
    .await;
    assert!(accepted >= STOCK as usize, "accepted {accepted}");
    let report = common::sold_out_converged(&env, STOCK, 982).await;
    assert!(report.ok(), "{:?}", report.violations);
    // It bit: order transactions cut by the restart and rolled back, then retried in-process
    // or redelivered by the broker.
    let port = roles.consumers[0].1;
    let rolled_back = metric(port, "order_tx_retry_total", r#"kind="create""#).await
        + metric(port, "mq_consume_total", r#"result="transient""#).await
        + metric(port, "mq_consume_total", r#"result="unknown""#).await;
    eprintln!("evidence: {rolled_back} order transactions rolled back");
    assert!(
        rolled_back > 0.0,
        "no order transaction was rolled back: the restart bit nothing"
    );
    finish(roles, env).await;
}
