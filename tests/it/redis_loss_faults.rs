//! Redis forgets the last second of acknowledged writes mid-sale
//! (docs/architecture/redis.md#when-redis-forgets), judged from the buyers' side, on both
//! topologies: a Redis of the test's own (AOF, `appendfsync everysec`) restarted from its
//! append-only file as it was a moment earlier (what a host crash leaves), and the test Redis
//! Cluster with the activity's primary killed while its replica had stopped copying, the replica
//! promoted (what a failover to a lagging replica leaves). Buyers retry with the same request id
//! until they get a final answer; afterwards every winner retries once more, and asks again with a
//! new request id. Verdict: no request id answered with two reservations, no buyer answered 202 for
//! two reservations, every 202 an order, the stock sold exactly, Redis equal to PostgreSQL. Ignored
//! by `make test`: run by `make test-faults`.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_redis::redis::AsyncCommands;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::common::{self, eventually, free_port, Proc, TestEnv};

pub(crate) const STOCK: i32 = 300;
pub(crate) const BUYERS: i64 = 900;
/// A consumer slower than the buyers: an order backlog stands when Redis forgets.
pub(crate) const THROTTLED: &str = "consume-inside-transaction=sleep(50)";

/// A Redis of this test's own, persisting like production: AOF, fsync every second.
pub(crate) struct OwnRedis {
    port: u16,
    dir: PathBuf,
    proc: Option<Proc>,
    /// When the server was last started.
    pub(crate) started: chrono::DateTime<chrono::Utc>,
}

impl OwnRedis {
    pub(crate) async fn start() -> Self {
        let port = free_port();
        let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
        let dir = PathBuf::from(home).join(format!(".cache/seckill/redis-loss/{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = Self {
            port,
            dir,
            proc: None,
            started: chrono::Utc::now(),
        };
        r.run().await;
        r
    }

    /// Starts the server over what its directory holds, and waits until it answers.
    async fn run(&mut self) {
        self.started = chrono::Utc::now();
        let child = std::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.proc = Some(Proc(child, None));
        let port = self.port;
        eventually(30, "the test's Redis answers", || async move {
            std::process::Command::new("redis-cli")
                .args(["-p", &port.to_string(), "ping"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        })
        .await;
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn aof(&self) -> PathBuf {
        self.dir.join("appendonlydir")
    }

    /// A copy of the append-only files as they are now (what was written, fsynced or not).
    pub(crate) fn snapshot(&self) -> PathBuf {
        let to = self.dir.with_extension("snapshot");
        let _ = std::fs::remove_dir_all(&to);
        let ok = std::process::Command::new("cp")
            .arg("-r")
            .arg(self.aof())
            .arg(&to)
            .status()
            .unwrap();
        assert!(ok.success());
        to
    }

    /// `kill -9`, the append-only files put back as they were at `snapshot`, started again.
    pub(crate) async fn crash_back_to(&mut self, snapshot: &PathBuf) {
        if let Some(mut p) = self.proc.take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
        std::fs::remove_dir_all(self.aof()).unwrap();
        std::fs::rename(snapshot, self.aof()).unwrap();
        self.run().await;
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        drop(self.proc.take());
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(self.dir.with_extension("snapshot"));
    }
}

/// One answer a buyer got.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) user: i64,
    pub(crate) request_id: String,
    pub(crate) status: u16,
    pub(crate) reservation_id: Option<String>,
    pub(crate) code: String,
}

pub(crate) type History = Arc<Mutex<Vec<Answer>>>;

/// Asks until a final answer (anything but a 503 or a failed connection), each answer kept.
pub(crate) async fn ask(
    client: &reqwest::Client,
    base: &str,
    activity: i64,
    user: i64,
    request_id: &str,
    h: &History,
) -> u16 {
    let url = format!("{base}/v1/activities/{activity}/skus/1/reservations");
    for _ in 0..1200 {
        let r = client
            .post(&url)
            .header("authorization", common::bearer(user))
            .json(&json!({"user_id": user, "request_id": request_id, "quantity": 1}))
            .send()
            .await;
        let Ok(r) = r else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        h.lock().unwrap().push(Answer {
            user,
            request_id: request_id.to_string(),
            status,
            reservation_id: body["reservation_id"].as_str().map(str::to_string),
            code: body["error"]["code"].as_str().unwrap_or("").to_string(),
        });
        if status != 503 {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("buyer {user} got no final answer in 2 minutes");
}

pub(crate) fn accepted(h: &History) -> usize {
    h.lock().unwrap().iter().filter(|a| a.status == 202).count()
}

/// The meta's reservation sequence of the activity, and the keys Redis holds (on a cluster:
/// the node the seed answers from).
pub(crate) async fn seq_and_keys(redis: &seckill::redis::RedisStore, activity: i64) -> (i64, i64) {
    let mut c = redis.pool.get().await.unwrap();
    let seq: Option<i64> = c.hget(redis.keys.meta(activity), "seq").await.unwrap();
    let keys: i64 = deadpool_redis::redis::cmd("DBSIZE")
        .query_async(&mut *c)
        .await
        .unwrap_or(0);
    (seq.unwrap_or(0), keys)
}

/// The roles, the consumer throttled below the buyers' rate (an order backlog stands when
/// Redis forgets), resuming through a 5 s ramp.
pub(crate) async fn start_roles(env: &TestEnv) -> crate::redis_loss::Roles {
    crate::redis_loss::start(env, 5, THROTTLED).await
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Buyers 1..=`buyers`, 8 at a time, each until a final answer; about 120 buyers/s.
pub(crate) fn start_load(
    base: &str,
    activity: i64,
    history: &History,
    buyers: i64,
) -> tokio::task::JoinHandle<()> {
    let (client, base, h) = (client(), base.to_string(), history.clone());
    tokio::spawn(
        futures::stream::iter(1..=buyers).for_each_concurrent(8, move |user| {
            let (client, base, h) = (client.clone(), base.clone(), h.clone());
            async move {
                ask(&client, &base, activity, user, &format!("r{user}"), &h).await;
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
        }),
    )
}

/// Waits until `at_least` reservations were answered 202.
pub(crate) async fn answered(history: &History, at_least: usize) {
    let h = history.clone();
    eventually(60, "reservations answered", move || {
        let h = h.clone();
        async move { accepted(&h) >= at_least }
    })
    .await;
}

/// Every winner asks again: with its request id (the same reservation), and with a new one
/// (never a second 202).
async fn winners_ask_again(base: &str, activity: i64, history: &History) {
    let winners: HashSet<(i64, String)> = history
        .lock()
        .unwrap()
        .iter()
        .filter(|a| a.status == 202)
        .map(|a| (a.user, a.request_id.clone()))
        .collect();
    let client = client();
    for (user, request_id) in &winners {
        ask(&client, base, activity, *user, request_id, history).await;
        ask(
            &client,
            base,
            activity,
            *user,
            &format!("again-{user}"),
            history,
        )
        .await;
    }
}

#[tokio::test]
#[ignore = "runs its own Redis and crashes it: run by `make test-faults`, one test at a time"]
async fn redis_forgetting_its_last_second_mid_sale_tells_no_buyer_twice() {
    const ACTIVITY: i64 = 991;
    let mut redis = OwnRedis::start().await;
    let mut env = TestEnv::with_topics().await;
    env.settings.redis.url = redis.url().into();
    env.activity(ACTIVITY, 1, STOCK).await;
    let roles = start_roles(&env).await;
    let base = roles.base.clone();
    let history: History = Arc::default();
    let load = start_load(&base, ACTIVITY, &history, BUYERS);

    // A third of the stock answered: the append-only file as it is now is what Redis will
    // come back with; the sale runs on until 40 more reservations were answered.
    answered(&history, STOCK as usize / 3).await;
    let snapshot = redis.snapshot();
    let at_snapshot = accepted(&history);
    answered(&history, at_snapshot + 40).await;
    let (seq_before, keys_before) = seq_and_keys(&env.redis().await, ACTIVITY).await;
    redis.crash_back_to(&snapshot).await;
    let restarted = redis.started;
    let (seq_after, keys_after) = seq_and_keys(&env.redis().await, ACTIVITY).await;
    // The fault bit: Redis came back without writes it had acknowledged.
    assert!(
        seq_after < seq_before,
        "writes lost: seq {seq_before} -> {seq_after}"
    );
    eprintln!("Redis restarted from its AOF: seq {seq_before} -> {seq_after}, keys {keys_before} -> {keys_after}");
    load.await.unwrap();
    winners_ask_again(&base, ACTIVITY, &history).await;
    verdict(&env, ACTIVITY, &history, restarted, seq_before - seq_after).await;
    roles.stop().await;
    env.cleanup().await;
}

/// `INFO server`'s process id of the node on `port`.
fn node_pid(port: u16) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "info", "server"])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .map(|p| p.trim().to_string())
        .expect("the node answers INFO")
}

fn signal(pid: &str, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, pid])
        .status()
        .unwrap();
    assert!(ok.success(), "kill {sig} {pid}");
}

/// Sends SIGCONT when dropped.
struct Continue(String);

impl Drop for Continue {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn cluster_up(args: &[&str]) {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/redis-cluster-up.sh");
    let ok = std::process::Command::new(script)
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success(), "redis-cluster-up.sh {args:?}");
}

#[tokio::test]
#[ignore = "kills a Redis Cluster primary and promotes its lagging replica: run by `make test-faults`, one test at a time"]
async fn a_cluster_primary_lost_before_its_replica_copied_tells_no_buyer_twice() {
    const ACTIVITY: i64 = 992;
    let env = TestEnv::with_topics().await.on_redis_cluster();
    env.activity(ACTIVITY, 1, STOCK).await;
    // Connected before the fault: a new cluster connection waits on a seed that is stopped.
    let store = env.redis().await;
    let slot = store.keys.slot(ACTIVITY);
    let (primary, replica) = crate::sale_faults::settled_primary_and_replica(slot).await;
    let roles = start_roles(&env).await;
    let base = roles.base.clone();
    let history: History = Arc::default();
    let load = start_load(&base, ACTIVITY, &history, BUYERS);

    // A third of the stock answered: the replica stops copying (stopped, then killed with
    // what its socket held); the primary answers 40 more reservations and dies.
    answered(&history, STOCK as usize / 3).await;
    let (primary_pid, replica_pid) = (node_pid(primary), node_pid(replica));
    signal(&replica_pid, "-STOP");
    // Whatever happens next, the node is not left stopped for the tests after this one.
    let _resume = Continue(replica_pid.clone());
    let at_stop = accepted(&history);
    answered(&history, at_stop + 40).await;
    let (seq_before, _) = seq_and_keys(&store, ACTIVITY).await;
    signal(&primary_pid, "-KILL");
    signal(&replica_pid, "-KILL");
    // The replica comes back from its own append-only file and takes the slots over; the old
    // primary comes back as its replica, giving up what it alone had.
    cluster_up(&["--node", &replica.to_string()]);
    let ok = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &replica.to_string(),
            "cluster",
            "failover",
            "takeover",
        ])
        .status()
        .unwrap();
    assert!(ok.success());
    eventually(30, "the lagging replica serving the activity", || async {
        crate::sale_faults::primary_and_replica(slot).0 == Some(replica)
    })
    .await;
    let restarted = chrono::Utc::now();
    cluster_up(&[]);
    let (seq_after, _) = seq_and_keys(&store, ACTIVITY).await;
    assert!(
        seq_after < seq_before,
        "writes lost: seq {seq_before} -> {seq_after}"
    );
    eprintln!("slot {slot}: :{primary} killed, :{replica} promoted behind it: seq {seq_before} -> {seq_after}");
    load.await.unwrap();
    winners_ask_again(&base, ACTIVITY, &history).await;
    verdict(&env, ACTIVITY, &history, restarted, seq_before - seq_after).await;
    roles.stop().await;
    env.cleanup().await;
}

/// The client-side verdict, then PostgreSQL and Redis agreeing; prints the evidence.
async fn verdict(
    env: &TestEnv,
    activity: i64,
    history: &History,
    restarted: chrono::DateTime<chrono::Utc>,
    lost: i64,
) {
    let h = history.lock().unwrap().clone();
    let mut by_request: HashMap<(i64, &str), HashSet<&str>> = HashMap::new();
    let mut by_buyer: HashMap<i64, HashSet<&str>> = HashMap::new();
    for a in h.iter().filter(|a| a.status == 202) {
        let rid = a
            .reservation_id
            .as_deref()
            .expect("a 202 names its reservation");
        by_request
            .entry((a.user, &a.request_id))
            .or_default()
            .insert(rid);
        by_buyer.entry(a.user).or_default().insert(rid);
    }
    let twice_by_request: Vec<_> = by_request.iter().filter(|(_, r)| r.len() > 1).collect();
    let twice_by_buyer: Vec<_> = by_buyer.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        twice_by_request.is_empty(),
        "request ids with two reservations: {twice_by_request:?}"
    );
    assert!(
        twice_by_buyer.is_empty(),
        "buyers answered 202 for two reservations: {twice_by_buyer:?}"
    );
    let again_202 = h
        .iter()
        .filter(|a| a.request_id.starts_with("again-") && a.status == 202)
        .count();
    assert_eq!(
        again_202, 0,
        "a winner asking with a new request id got a second 202"
    );
    let paused = h.iter().filter(|a| a.code == "SALE_PAUSED").count();

    let r = common::sold_out_converged(env, STOCK, activity).await;
    assert_eq!(
        r.figures.rejected, 0,
        "no 202 ended rejected: {:?}",
        r.figures
    );
    let winners = by_buyer.len() as i64;
    assert_eq!(
        winners, STOCK as i64,
        "every unit went to a buyer told 202, once"
    );
    common::assert_no_stock_drift(env).await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let f = client
        .query_one(
            "SELECT signal, extract(epoch FROM detected_at - $2::timestamptz)::float8,
                    extract(epoch FROM resumed_at - detected_at)::float8,
                    (rebuild->>'rebuild_secs')::float8,
                    (rebuild->'diff'->>'requests_restored')::int8
             FROM redis_fences WHERE activity_id = $1",
            &[&activity, &restarted],
        )
        .await
        .expect("exactly one fence");
    let (signal, detect, fenced, rebuild, restored): (String, f64, f64, f64, i64) =
        (f.get(0), f.get(1), f.get(2), f.get(3), f.get(4));
    eprintln!(
        "evidence: {lost} acknowledged reservations lost; detected by {signal} {detect:.2}s after \
         the restart; fenced {fenced:.2}s (rebuild {rebuild:.3}s, {restored} request ids \
         restored); {paused} SALE_PAUSED answers; verdict: 0 request ids with two reservations, \
         0 buyers told 202 twice, {} orders for a stock of {STOCK}, stock drift 0",
        r.figures.valid_orders
    );
}
