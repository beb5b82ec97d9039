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

use crate::common;
use crate::common::metric;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{caught_up, eventually, free_port, spawn, wait_ready, Proc, TestEnv};
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
    let port = free_port();
    let p = spawn(
        env,
        &["consume", "--workers", "2"],
        failpoints,
        &[
            (
                "SECKILL__CONSUMER__METRICS_LISTEN",
                format!("127.0.0.1:{port}"),
            ),
            ("SECKILL__CONSUMER__BATCH_SIZE", "4".to_string()),
        ],
    );
    (p, port)
}

pub(crate) async fn start_roles(env: &TestEnv, consumers: usize, first_consumers: &str) -> Roles {
    let (api_port, api_ops) = (free_port(), free_port());
    let scan_port = free_port();
    let api = spawn(
        env,
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
    let scan = spawn(
        env,
        &["scan"],
        "",
        &[
            (
                "SECKILL__SCAN__METRICS_LISTEN",
                format!("127.0.0.1:{scan_port}"),
            ),
            // Confirmed sends a dead broker holds go out again 3 s after the consumers'
            // progress on the live one (10 s by default).
            ("SECKILL__SCAN__UNCONSUMED_RESEND_MS", "3000".to_string()),
        ],
    );
    let consumers: Vec<(Proc, u16)> = (0..consumers)
        .map(|_| start_consumer(env, first_consumers))
        .collect();
    wait_ready(format!("http://127.0.0.1:{api_port}/readyz")).await;
    wait_ready(format!("http://127.0.0.1:{scan_port}/readyz")).await;
    for (_, port) in &consumers {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }
    Roles {
        api,
        api_port,
        api_ops,
        consumers,
        scan,
        scan_port,
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

/// The second master `SECKILL_MQ_BROKERS=2 scripts/rocketmq-up.sh` starts.
const BROKER_B: &str = "127.0.0.1:10921";

/// `scripts/rocketmq-up.sh` with a second master.
fn two_brokers_up() -> std::process::ExitStatus {
    script_with("rocketmq-up.sh", &[], &[("SECKILL_MQ_BROKERS", "2")])
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

/// Messages the second master stored for `topic` (its consume-queue files are there once it
/// took any).
fn stored_on_b(topic: &str) -> usize {
    let data = std::env::var("SECKILL_MQ_DATA_DIR").map_or_else(
        |_| Path::new(&std::env::var("HOME").unwrap()).join(".cache/seckill/rocketmq-data"),
        Into::into,
    );
    std::fs::read_dir(data.join("store-b/consumequeue").join(topic))
        .map(|queues| queues.count())
        .unwrap_or(0)
}

#[tokio::test]
#[ignore = "starts and kills a second broker: run by `make test-faults`, one test at a time"]
async fn one_of_two_brokers_killed_mid_sale_loses_and_doubles_nothing() {
    assert!(two_brokers_up().success(), "second broker started");
    // Topics on both masters: sends and consumer groups spread over the two.
    let mut env = TestEnv::without_topics().await;
    env.settings.mq.broker_addr = format!("{},{BROKER_B}", env.settings.mq.broker_addr);
    seckill::roles::ops::topics::create_all(&env.settings)
        .await
        .expect("topics on both brokers");
    env.activity(983, 1, STOCK).await;
    let roles = start_roles(&env, 1, THROTTLED).await;
    let names = env.names();
    let topic = names.order_create_topic.clone();
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    let (api_port, api_ops) = (roles.api_port, roles.api_ops);
    let unconfirmed = || async move {
        metric(api_ops, "mq_publish_total", r#"outcome="unknown""#).await
            + metric(api_ops, "mq_publish_total", r#"outcome="definite_failure""#).await
    };
    let killed_at = std::cell::Cell::new(None);
    let consumer = std::cell::RefCell::new(None);
    let mut roles = roles;
    let mut first_consumer = roles.consumers.remove(0);
    let accepted = sale_with(&env, 983, api_port, || async {
        assert!(
            stored_on_b(&topic) > 0,
            "the second broker took none of the sale's messages before the kill"
        );
        // A consumer pulls ahead into its own cache, so a broker dies holding unconsumed
        // messages only while nobody pulls them: the consumer goes first, and the order
        // backlog builds on both brokers' queues.
        sigkill(&mut first_consumer.0);
        eventually(20, "an order backlog of 30 messages", || async {
            matches!(probe.lag(&names.order_create_group, &topic).await, Ok(l) if l.messages >= 30)
        })
        .await;
        sigkill_server("broker-b.pid");
        let at = std::time::Instant::now();
        killed_at.set(Some(at));
        // A new consumer, which finds only the live broker's queues.
        let (p, port) = start_consumer(&env, THROTTLED);
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
        *consumer.borrow_mut() = Some((p, port));
        // The sale goes on against the one broker left; the producer learns to route around
        // the dead one. How long sends keep failing after the kill (sampled every 100 ms).
        let (mut last, mut last_change) = (unconfirmed().await, Duration::ZERO);
        while at.elapsed() < Duration::from_secs(8) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = unconfirmed().await;
            if now > last {
                (last, last_change) = (now, at.elapsed());
            }
        }
        eprintln!(
            "measured: {last} sends unconfirmed in all; the last one {:.1} s after the kill",
            last_change.as_secs_f64()
        );
    })
    .await;
    roles.consumers.push(
        consumer
            .into_inner()
            .expect("a consumer started after the kill"),
    );
    assert!(accepted >= STOCK as usize, "accepted {accepted}");
    // The second broker stays dead: what it held reaches the consumers as the scanner's
    // copies through the live one.
    let report = common::sold_out_converged(&env, STOCK, 983).await;
    assert!(report.ok(), "{:?}", report.violations);
    let resent = metric(
        roles.scan_port,
        "reservation_unconsumed_resend_total",
        r#"outcome="confirmed""#,
    )
    .await;
    eprintln!(
        "measured: every reservation an order {:.1} s after the kill, the second broker still dead; \
         {resent} confirmed sends it held sent again",
        killed_at.get().unwrap().elapsed().as_secs_f64()
    );
    assert!(
        resent > 0.0,
        "the dead broker held no unconsumed order message: the fault did not bite"
    );
    // Back: its stranded copies are delivered and the inbox absorbs every one of them.
    let consumer_port = roles.consumers[0].1;
    let before = metric(consumer_port, "mq_duplicate_message_total", "").await;
    assert!(two_brokers_up().success(), "second broker restarted");
    eventually(
        120,
        "the returned broker's copies absorbed as duplicates",
        || async { metric(consumer_port, "mq_duplicate_message_total", "").await > before },
    )
    .await;
    eprintln!(
        "evidence: {} duplicates absorbed after the broker came back",
        metric(consumer_port, "mq_duplicate_message_total", "").await - before
    );
    let report = common::sold_out_converged(&env, STOCK, 983).await;
    assert!(report.ok(), "{:?}", report.violations);
    finish(roles, env).await;
    probe.shutdown().await;
    // Back to one broker for the other tests, and the second one's store gone.
    assert!(
        script_with("rocketmq-down.sh", &["--second-broker"], &[]).success(),
        "second broker stopped"
    );
}

/// `CLUSTER NODES` of the test Redis Cluster, one line per node.
fn cluster_nodes() -> Vec<String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", "7001", "cluster", "nodes"])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The port of a node's `CLUSTER NODES` line.
fn node_port(line: &str) -> u16 {
    let addr = line.split_whitespace().nth(1).unwrap();
    addr.split(['@', ':']).nth(1).unwrap().parse().unwrap()
}

/// The port of the healthy primary serving `slot`, and of a healthy replica of it, as the
/// cluster sees them now (either may be missing while a failover settles).
pub(crate) fn primary_and_replica(slot: u16) -> (Option<u16>, Option<u16>) {
    let nodes = cluster_nodes();
    let serves = |line: &str| {
        line.split_whitespace().skip(8).any(|range| {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            matches!((lo.parse::<u16>(), hi.parse::<u16>()), (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot))
        })
    };
    let Some(primary) = nodes
        .iter()
        .find(|l| l.contains("master") && !l.contains("fail") && serves(l))
    else {
        return (None, None);
    };
    let id = primary.split_whitespace().next().unwrap();
    let replica = nodes
        .iter()
        .find(|l| l.split_whitespace().nth(3) == Some(id) && !l.contains("fail"));
    (Some(node_port(primary)), replica.map(|l| node_port(l)))
}

/// [`primary_and_replica`] once both are there (within 60 s).
pub(crate) async fn settled_primary_and_replica(slot: u16) -> (u16, u16) {
    for _ in 0..600 {
        if let (Some(primary), Some(replica)) = primary_and_replica(slot) {
            return (primary, replica);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no primary with a replica serves slot {slot} after 60 s");
}

#[tokio::test]
#[ignore = "fails a Redis Cluster primary over: run by `make test-faults`, one test at a time"]
async fn a_redis_primary_failed_over_mid_sale_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await.on_redis_cluster();
    env.activity(984, 1, STOCK).await;
    let slot = env.redis().await.keys.slot(984);
    // A failover earlier (this test's last run) may still be settling.
    let (primary, replica) = settled_primary_and_replica(slot).await;
    let roles = start_roles(&env, 1, THROTTLED).await;
    let accepted = sale_with(&env, 984, roles.api_port, || async {
        // The replica takes the activity's slot over while reservations are being made: the
        // roles' connections get MOVED and follow the new slot map.
        let status = std::process::Command::new("redis-cli")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &replica.to_string(),
                "cluster",
                "failover",
            ])
            .stdout(std::process::Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(status.success());
        eventually(30, "the replica serving the activity", || async {
            primary_and_replica(slot).0 == Some(replica)
        })
        .await;
    })
    .await;
    assert!(accepted >= STOCK as usize, "accepted {accepted}");
    let report = common::sold_out_converged(&env, STOCK, 984).await;
    assert!(report.ok(), "{:?}", report.violations);
    // It bit: the slot moved from one node to the other during the sale.
    let (now_primary, _) = primary_and_replica(slot);
    eprintln!("evidence: slot {slot} moved from :{primary} to :{now_primary:?} mid-sale");
    assert_eq!(now_primary, Some(replica));
    finish(roles, env).await;
}

#[tokio::test]
#[ignore = "kills the shared broker: run by `make test-faults`, one test at a time"]
async fn the_broker_restarted_between_a_half_message_and_its_commit_delivers_the_event_once() {
    let env = TestEnv::with_topics().await;
    env.activity(984, 1, 5).await;
    let orders = common::created_orders(&env, 984, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = seckill::domain::events::order_paid_event_id(&oid, 2);
    let (collector, consumer, group) = common::collect_events(&env).await;
    // The API in transaction mode holds 4 s between its local commit and the commit message
    // (its PostgreSQL bound raised to cover it): the broker is killed and restarted then.
    let (api_port, api_ops) = (free_port(), free_port());
    let mut api = spawn(
        &env,
        &["api"],
        "tx-after-commit-before-end=sleep(4000)",
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{api_port}")),
            (
                "SECKILL__API__METRICS_LISTEN",
                format!("127.0.0.1:{api_ops}"),
            ),
            ("SECKILL__EVENTS__ORDER_PAID", "transaction".to_string()),
            ("SECKILL__PG__STATEMENT_TIMEOUT_MS", "10000".to_string()),
        ],
    );
    wait_ready(format!("http://127.0.0.1:{api_port}/readyz")).await;
    let paying = {
        let (base, oid) = (format!("http://127.0.0.1:{api_port}"), oid.clone());
        tokio::spawn(async move { common::notify_payment(&base, &oid, "pay-1", 100).await })
    };
    let in_transaction = format!(
        "SELECT count(*) FROM event_outbox WHERE event_id = '{event_id}' AND status = 'TRANSACTION'"
    );
    eventually(10, "the local transaction committed", || async {
        env.count(&in_transaction).await == 1
    })
    .await;
    let before = std::fs::read_to_string(run_dir().join("broker.pid")).unwrap();
    sigkill_server("broker.pid");
    assert_eq!(
        env.count(&in_transaction).await,
        1,
        "killed before the commit message (the row is marked after it)"
    );
    assert!(script("rocketmq-up.sh").success(), "broker restarted");
    let after = std::fs::read_to_string(run_dir().join("broker.pid")).unwrap();
    assert_ne!(before, after, "another broker process");
    let (status, body) = paying.await.unwrap();
    assert_eq!(status, 200, "{body}");

    // Delivered once: by the commit message if the new broker got it, else by its check-back.
    eventually(150, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    caught_up(&env, &group, &env.names().order_event_topic).await;
    let paid = collector.paid(&oid);
    assert_eq!(paid.len(), 1, "delivered once");
    assert_eq!(paid[0].properties["message_id"], event_id);
    let commits = metric(api_ops, "mq_transaction_end_total", r#"outcome="commit""#).await;
    let checks = metric(api_ops, "mq_transaction_check_total", r#"answer="commit""#).await;
    eprintln!(
        "evidence: broker pid {} -> {}, ends commit {commits}, check-backs commit {}",
        before.trim(),
        after.trim(),
        checks.abs()
    );
    assert_eq!(
        commits, 1.0,
        "the API ended the half with a commit after the restart"
    );
    let _ = api.terminate(20).await;
    assert!(consumer.shutdown().await);
    env.cleanup().await;
}

/// `seckill consume` given both name servers, throttled like the others.
fn consumer_of_both(env: &TestEnv) -> (Proc, u16) {
    let port = free_port();
    let p = spawn(
        env,
        &["consume", "--workers", "2"],
        THROTTLED,
        &[
            (
                "SECKILL__CONSUMER__METRICS_LISTEN",
                format!("127.0.0.1:{port}"),
            ),
            ("SECKILL__CONSUMER__BATCH_SIZE", "4".to_string()),
            ("SECKILL__MQ__NAME_SERVER", BOTH_NAME_SERVERS.to_string()),
        ],
    );
    (p, port)
}

/// `rocketmq-up.sh` with two name servers (a broker registered with one only is restarted).
fn both_name_servers() -> bool {
    script_with("rocketmq-up.sh", &[], &[("SECKILL_MQ_NAMESRVS", "2")]).success()
}

/// Waits until the name server at `addr`, asked alone, routes the order topic to the broker.
async fn routes_on(addr: &str, env: &TestEnv) {
    let names = env.names();
    let probe = seckill::mq::rocketmq::LagProbe::new(&seckill::mq::runtime().unwrap(), addr)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    eventually(60, "the restarted name server routes the topic", || async {
        probe
            .lag(&names.order_create_group, &names.order_create_topic)
            .await
            .is_ok()
    })
    .await;
    eprintln!(
        "{addr} routes the topic {:?} after its restart",
        started.elapsed()
    );
    probe.shutdown().await;
}

/// The two name servers `make services-up` starts, as a shop lists them.
const BOTH_NAME_SERVERS: &str = "127.0.0.1:9876;127.0.0.1:9877";

#[tokio::test]
#[ignore = "kills the shared name servers: run by `make test-faults`, one test at a time"]
async fn each_name_server_killed_in_turn_mid_sale_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await;
    assert!(
        both_name_servers(),
        "both name servers up, the broker registered with both"
    );
    for (activity, stock) in [(985, STOCK), (986, 20), (987, 20)] {
        env.activity(activity, 1, stock).await;
    }
    let both = || ("SECKILL__MQ__NAME_SERVER", BOTH_NAME_SERVERS.to_string());
    let (api_port, api_ops, scan_port) = (free_port(), free_port(), free_port());
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
            both(),
        ],
    );
    let mut scan = spawn(
        &env,
        &["scan"],
        "",
        &[
            (
                "SECKILL__SCAN__METRICS_LISTEN",
                format!("127.0.0.1:{scan_port}"),
            ),
            both(),
        ],
    );
    let consumer = std::cell::RefCell::new(consumer_of_both(&env));
    let first_consumer_port = consumer.borrow().1;
    for port in [api_port, scan_port, first_consumer_port] {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }
    let orders = || env.count("SELECT count(*) FROM orders");
    // While one name server is dead: a new consumer finds its routes on the other alone, and
    // 20 buyers of another activity, sent by the API meanwhile, each become an order.
    let one_dead = |dead: &'static str, activity: i64| {
        let (consumer, env) = (&consumer, &env);
        async move {
            sigkill(&mut consumer.borrow_mut().0);
            let (p, port) = consumer_of_both(env);
            wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
            let base = format!("http://127.0.0.1:{api_port}");
            for user in 1..=20 {
                let (s, b) = common::reserve_as(&base, activity, 1, user, "one-dead").await;
                assert_eq!(s, reqwest::StatusCode::ACCEPTED, "{b}");
            }
            let created = format!("SELECT count(*) FROM orders WHERE activity_id = {activity}");
            eventually(60, "orders created with one name server dead", || async {
                env.count(&created).await == 20
            })
            .await;
            let down = metric(port, "mq_name_server_down_total", dead).await;
            eprintln!(
                "{dead} dead: 20 reservations sent and made orders by a consumer started then, \
                 which counted it down {down} time(s)"
            );
            assert!(down >= 1.0, "the new consumer saw {dead} down");
            *consumer.borrow_mut() = (p, port);
        }
    };
    let accepted = sale_with(&env, 985, api_port, || async {
        sigkill_server("namesrv.pid");
        eprintln!(
            "name server a (9876) SIGKILLed at {} orders",
            orders().await
        );
        one_dead("9876", 986).await;
        assert!(both_name_servers(), "name server a restarted");
        // A restarted name server knows no route until the broker registers again (every
        // 10 s here): the other one is killed only once this one answers for the topic.
        routes_on("127.0.0.1:9876", &env).await;
        sigkill_server("namesrv-b.pid");
        eprintln!(
            "name server b (9877) SIGKILLed at {} orders",
            orders().await
        );
        one_dead("9877", 987).await;
        assert!(both_name_servers(), "name server b restarted");
    })
    .await;
    assert!(accepted > 0);
    let report = common::sold_out_converged(&env, STOCK, 985).await;
    assert!(report.ok(), "{:?}", report.violations);
    for activity in [986, 987] {
        let r = env.invariants(activity, 1).await;
        assert!(r.ok() && r.figures.valid_orders == 20, "{activity}: {r:?}");
    }
    // The relay went on sending: every event due by now is out (the orders' cancel timers
    // wait in the outbox until near their deliver time).
    eventually(60, "the outbox sent what is due", || async {
        let due = "SELECT count(*) FROM event_outbox WHERE status = 'PENDING' \
                   AND next_attempt_at <= now()";
        env.count(due).await == 0
    })
    .await;
    let sent = env
        .count("SELECT count(*) FROM event_outbox WHERE status = 'SENT'")
        .await;
    assert!(sent >= STOCK as i64 + 40, "{sent} events sent");
    // It bit, and each long-running role saw both outages.
    for (role, port) in [("api", api_ops), ("scan", scan_port)] {
        let a = metric(port, "mq_name_server_down_total", "9876").await;
        let b = metric(port, "mq_name_server_down_total", "9877").await;
        eprintln!("evidence: {role} counted name server a down {a}, b down {b}");
        assert!(a >= 1.0 && b >= 1.0, "{role} saw both name servers go down");
    }
    let _ = api.terminate(20).await;
    let _ = scan.terminate(20).await;
    let mut last_consumer = consumer.into_inner();
    let _ = last_consumer.0.terminate(40).await;
    env.cleanup().await;
    // The shared broker back to the one name server the other tests use.
    assert!(
        script("rocketmq-up.sh").success(),
        "back to one name server"
    );
}
