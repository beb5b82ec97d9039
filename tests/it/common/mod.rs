//! Shared set-up for the integration tests: every test gets its own PostgreSQL schema, Redis
//! key prefix and environment name (so its own topics and consumer groups) on the real
//! services that `make test` starts.
#![allow(dead_code)]

pub mod sale;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use seckill::config::Settings;
use seckill::domain::{Ids, OrderCreateRequested, TraceContext};
use seckill::mq::Delivery;
use seckill::pg::queries::{create_activity, ActivitySpec};
use seckill::redis::RedisStore;

/// Held by a test for as long as it sets a failpoint inside the test process (the failpoint
/// registry is global to the process): no two such tests overlap (`tests/isolated/`).
pub async fn process_failpoints() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

pub struct TestEnv {
    pub settings: Settings,
    pub id: String,
}

impl TestEnv {
    /// This environment's topic and group names.
    pub fn names(&self) -> seckill::mq::Names {
        seckill::mq::Names::of(&self.settings)
    }

    /// A fresh, migrated schema and key prefix, and this environment's topics on the broker.
    pub async fn with_topics() -> Self {
        Self::new(true).await
    }

    /// A fresh, migrated schema and key prefix; no topics (a test that never touches the
    /// broker, or creates what it needs itself).
    pub async fn without_topics() -> Self {
        Self::new(false).await
    }

    async fn new(with_topics: bool) -> Self {
        seckill::telemetry::init_logs(&seckill::config::TelemetrySettings {
            log_level: "warn,rocketmq_client_rust=error,rocketmq_runtime=error".into(),
            json: false,
        });
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut settings = Settings::load_from(&dir).expect("config loads");
        let ulid = ulid::Ulid::new().to_string().to_lowercase();
        let id = ulid[ulid.len() - 10..].to_string();
        settings.env = format!("T{}", id.to_uppercase());
        settings.pg.schema = format!("t_{id}");
        settings.redis.key_prefix = format!("t-{id}");
        settings.api.listen = "127.0.0.1:0".parse().unwrap();
        settings.consumer.metrics_listen = "127.0.0.1:0".parse().unwrap();
        settings.validate().expect("test settings are valid");
        seckill::pg::migrate(&settings.pg)
            .await
            .expect("migrations apply");
        if with_topics {
            seckill::roles::ops::topics::create_all(&settings)
                .await
                .expect("topics and groups created (is the broker up? run `make services-up`)");
        }
        Self { settings, id }
    }

    pub async fn pool(&self, size: usize) -> deadpool_postgres::Pool {
        seckill::pg::connect_pool(&self.settings.pg, size)
            .await
            .expect("pg pool")
    }

    /// A pool like the order consumer's: its connections reuse plans (`PlanCache::Reuse`).
    pub async fn order_pool(&self, size: usize) -> deadpool_postgres::Pool {
        let reuse = seckill::pg::PlanCache::Reuse;
        seckill::pg::connect_pool_with(&self.settings.pg, size, reuse)
            .await
            .expect("pg pool")
    }

    pub async fn redis(&self) -> RedisStore {
        RedisStore::connect(&self.settings.redis)
            .await
            .expect("redis")
    }

    /// An activity that started a second ago, with one SKU, in PostgreSQL and Redis.
    pub async fn activity(&self, activity_id: i64, sku_id: i64, stock: i32) {
        self.activity_skus(activity_id, &[(sku_id, stock)]).await
    }

    /// An open activity with these `(sku_id, stock)`, in PostgreSQL and warmed into Redis.
    pub async fn activity_skus(&self, activity_id: i64, skus: &[(i64, i32)]) {
        self.activity_in_buckets(activity_id, skus, 1).await
    }

    /// An open activity whose SKUs' stock is split into `buckets` stock buckets.
    pub async fn activity_in_buckets(&self, activity_id: i64, skus: &[(i64, i32)], buckets: i16) {
        let valid = self.settings.api.reservation_valid_secs as i32;
        self.activity_valid_for(activity_id, skus, buckets, valid)
            .await
    }

    /// An open activity whose reservations are valid `valid_secs`.
    pub async fn activity_valid_for(
        &self,
        activity_id: i64,
        skus: &[(i64, i32)],
        buckets: i16,
        valid_secs: i32,
    ) {
        let now = Utc::now();
        let spec = ActivitySpec {
            activity_id,
            name: "test sale".into(),
            starts_at: now - chrono::Duration::seconds(1),
            ends_at: now + chrono::Duration::hours(1),
            reservation_valid_secs: valid_secs,
            skus: skus.iter().map(|&(sku, stock)| (sku, stock, 100)).collect(),
            stock_buckets: buckets,
        };
        let pool = self.pool(1).await;
        let mut client = pool.get().await.unwrap();
        let c: &mut tokio_postgres::Client = &mut client;
        create_activity(c, &spec, now).await.expect("activity");
        let redis = self.redis().await;
        for &(sku_id, stock) in skus {
            redis
                .warm(
                    activity_id,
                    sku_id,
                    spec.starts_at.timestamp_millis(),
                    spec.ends_at.timestamp_millis(),
                    i64::from(spec.reservation_valid_secs) * 1000,
                    stock,
                    buckets as u16,
                )
                .await
                .expect("warm");
        }
    }

    /// Drops the schema, the Redis keys and the topics of this test (a test's topics left on
    /// the shared broker pile up run after run, and a broker with thousands of topics was seen
    /// to fail its start-up registration with the name server).
    pub async fn cleanup(self) {
        if self.settings.env.starts_with('T') && self.settings.env != "PROD" {
            let mut topics = seckill::roles::ops::topics::environment_topics(&self.settings);
            // The retry topic of the tests' own event collector group (collect_events).
            let collector = format!("CG_{}_EVENT_COLLECTOR", self.settings.env);
            topics.push(seckill::mq::lag::retry_topic(&collector));
            // A test that stopped the broker leaves them to the next prune; never fail on it.
            let delete = seckill::mq::delete_topics(&self.settings, &topics);
            let _ = tokio::time::timeout(Duration::from_secs(10), delete).await;
            let mut groups: Vec<String> = seckill::roles::ops::topics::group_plan(&self.settings)
                .into_iter()
                .map(|g| g.name)
                .collect();
            groups.push(collector);
            let delete = seckill::mq::delete_groups(&self.settings, &groups);
            let _ = tokio::time::timeout(Duration::from_secs(10), delete).await;
        }
        let pool = self.pool(1).await;
        let client = pool.get().await.unwrap();
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.settings.pg.schema
            ))
            .await
            .unwrap();
        let redis = self.redis().await;
        let mut conn = redis.pool.get().await.unwrap();
        let keys: Vec<String> = deadpool_redis::redis::cmd("KEYS")
            .arg(format!("{}:*", self.settings.redis.key_prefix))
            .query_async(&mut *conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = deadpool_redis::redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut *conn)
                .await
                .unwrap();
        }
    }

    /// count(*) of a query with no parameters.
    pub async fn count(&self, sql: &str) -> i64 {
        let pool = self.pool(1).await;
        let client = pool.get().await.unwrap();
        client.query_one(sql, &[]).await.unwrap().get(0)
    }
}

/// Waits until every Redis reservation of SKU 1 is recorded in PostgreSQL and the invariants
/// hold, then asserts the SKU sold out exactly (`stock` valid orders).
pub async fn sold_out_converged(
    env: &TestEnv,
    stock: i32,
    activity: i64,
) -> seckill::invariants::Report {
    eventually(
        240,
        "the pipeline converged with every invariant holding",
        || async {
            let r = env.invariants(activity, 1).await;
            r.ok() && r.figures.unrecorded == 0
        },
    )
    .await;
    let r = env.invariants(activity, 1).await;
    assert_eq!(
        r.figures.valid_orders,
        i64::from(stock),
        "sold out exactly: {:?}",
        r.figures
    );
    r
}

/// Polls `f` until it returns true or `secs` pass.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `group` has consumed every message on `topic`: lag 0, as the broker reads it
/// from the group's committed offsets (a consumer commits them every few seconds).
pub async fn caught_up(env: &TestEnv, group: &str, topic: &str) {
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    eventually(60, &format!("{group} caught up on {topic}"), || async {
        matches!(probe.lag(group, topic).await, Ok(lag) if lag.messages == 0)
    })
    .await;
}

/// Waits until the order-create group has consumed every message on its topic and no
/// reservation of the activity waits for a re-send. From then on nothing can create another
/// order for it, so a count taken after this proves an absence without a fixed sleep.
pub async fn quiescent(env: &TestEnv, activity_id: i64) {
    let names = seckill::mq::Names::of(&env.settings);
    let redis = env.redis().await;
    eventually(60, "no reservation waits for a re-send", || async {
        redis.pending_count(activity_id).await.unwrap() == 0
    })
    .await;
    caught_up(env, &names.order_create_group, &names.order_create_topic).await;
}

/// A valid ORDER_CREATE_REQUESTED for a buyer, valid for `valid_secs` (negative: already expired).
pub fn event(activity_id: i64, sku_id: i64, user_id: i64, valid_secs: i64) -> OrderCreateRequested {
    let ids = Ids::generate(activity_id, 0);
    let now = Utc::now();
    let created = if valid_secs > 0 {
        now
    } else {
        now + chrono::Duration::seconds(valid_secs - 60)
    };
    OrderCreateRequested {
        schema_version: 1,
        event_type: "ORDER_CREATE_REQUESTED".into(),
        message_key: ids.reservation_id.clone(),
        message_id: ids.message_id,
        request_id: format!("req-{user_id}"),
        reservation_id: ids.reservation_id,
        order_id: ids.order_id,
        activity_id,
        sku_id,
        user_id,
        quantity: 1,
        reservation_created_at: created,
        reservation_valid_until: now + chrono::Duration::seconds(valid_secs),
        created_at: now,
        retry_count: 0,
        replay_count: 0,
        producer: "test".into(),
        trace: TraceContext::default(),
        channel: None,
    }
}

/// The delivery a broker would hand the consumer for `body`.
pub fn delivery(topic: &str, message_id: Option<&str>, body: Vec<u8>) -> Delivery {
    let mut properties = seckill::mq::Properties::default();
    if let Some(id) = message_id {
        properties.insert("message_id".to_string(), id.to_string());
    }
    Delivery {
        topic: topic.to_string(),
        properties,
        body,
        broker_msg_id: format!("test-{}", ulid::Ulid::new()),
        ..Default::default()
    }
}

pub fn delivery_of(topic: &str, e: &OrderCreateRequested) -> Delivery {
    delivery(topic, Some(&e.message_id), e.encode())
}

/// `events` as one transaction of the order handler, every one of which must become an order.
pub async fn create_orders(
    h: &seckill::roles::consume::order_create::OrderCreateHandler,
    topic: &str,
    events: &[OrderCreateRequested],
) {
    let deliveries: Vec<_> = events.iter().map(|e| delivery_of(topic, e)).collect();
    let decisions = h.process(&deliveries).await.unwrap();
    assert!(
        decisions
            .iter()
            .all(|d| matches!(d, seckill::domain::Decision::Created { .. })),
        "{decisions:?}"
    );
}

pub type Shared<T> = Arc<T>;

impl TestEnv {
    /// Invariants 1, 2, 3, 5 and 6 for one activity SKU of this test.
    pub async fn invariants(&self, activity_id: i64, sku_id: i64) -> seckill::invariants::Report {
        let pool = self.pool(1).await;
        let client = pool.get().await.unwrap();
        seckill::invariants::check(
            &**client,
            &self.redis().await,
            &seckill::mq::Names::of(&self.settings).order_create_group,
            activity_id,
            sku_id,
        )
        .await
        .unwrap()
    }
}

/// A child process of the real binary, killed if the test fails before stopping it. Its
/// stderr (the logs) goes to a file when spawned by [`spawn`]: the tail is printed when it
/// exits non-zero, and the file stays if the test fails.
pub struct Proc(pub std::process::Child, pub Option<std::path::PathBuf>);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if let Some(log) = &self.1 {
            if std::thread::panicking() {
                eprintln!("logs of pid {} kept in {}", self.0.id(), log.display());
            } else {
                let _ = std::fs::remove_file(log);
            }
        }
    }
}

impl Proc {
    /// Waits for the process to exit on its own.
    pub async fn wait_exit(&mut self, secs: u64) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                if !s.success() {
                    self.print_log_tail(s);
                }
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "process still alive after {secs}s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The last lines the process logged, on the test's stderr (shown when the test fails).
    fn print_log_tail(&self, status: std::process::ExitStatus) {
        let Some(log) = &self.1 else { return };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(40)..];
        eprintln!(
            "pid {} exited {status}; last lines of {}:\n{}",
            self.0.id(),
            log.display(),
            tail.join("\n")
        );
    }

    /// SIGTERM, then waits for the exit.
    pub async fn terminate(&mut self, secs: u64) -> std::process::ExitStatus {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        self.wait_exit(secs).await
    }
}

/// A loopback port nobody listens on right now.
/// Reads until the server closes the connection (or resets it); what it sent, or `None` if the
/// connection is still open after `secs`.
pub async fn closed_within(mut s: tokio::net::TcpStream, secs: u64) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

pub fn free_port() -> u16 {
    // The kernel may hand the same free port to two tests whose processes have not bound it
    // yet; one of them then fails to start while the other answers its readiness probe. A
    // port handed out once in this run is never handed out again.
    static GIVEN: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

/// Starts `seckill <args>` configured for this test (schema, key prefix, env name) plus
/// `extra` variables; `failpoints` goes to `FAILPOINTS` (builds with the feature only).
pub fn spawn(env: &TestEnv, args: &[&str], failpoints: &str, extra: &[(&str, String)]) -> Proc {
    static SPAWNED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join("seckill-test-logs");
    std::fs::create_dir_all(&dir).expect("a directory for the roles' logs");
    let log = dir.join(format!(
        "{}-{}-{n}.log",
        env.id,
        args.first().unwrap_or(&"cli")
    ));
    let file = std::fs::File::create(&log).expect("a log file for the role");
    let mut cmd = command(env, args);
    cmd.env("FAILPOINTS", failpoints)
        .stdout(std::process::Stdio::null())
        .stderr(file);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().expect("binary starts"), Some(log))
}

/// `seckill consume --workers <workers>` serving /metrics and /readyz on a free port (returned).
/// `seckill <args>` listening on a free port given by `listen_key` (e.g.
/// `SECKILL__API__LISTEN`), with `extra` variables; the process and its port.
pub fn spawn_listening(
    env: &TestEnv,
    args: &[&str],
    listen_key: &str,
    extra: &[(&str, &str)],
) -> (Proc, u16) {
    let port = free_port();
    let mut vars: Vec<(&str, String)> = vec![(listen_key, format!("127.0.0.1:{port}"))];
    vars.extend(extra.iter().map(|(k, v)| (*k, (*v).to_string())));
    (spawn(env, args, "", &vars), port)
}

pub fn spawn_consume(env: &TestEnv, workers: &str, failpoints: &str) -> (Proc, u16) {
    let port = free_port();
    let p = spawn(
        env,
        &["consume", "--workers", workers],
        failpoints,
        &[(
            "SECKILL__CONSUMER__METRICS_LISTEN",
            format!("127.0.0.1:{port}"),
        )],
    );
    (p, port)
}

/// The sum of every sample of a counter on a role's `/metrics` whose labels contain `labels`
/// (0 when it has none yet).
pub async fn metric(port: u16, name: &str, labels: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            *series == name || (series.starts_with(&format!("{name}{{")) && series.contains(labels))
        })
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

/// The value of one sample (`name{labels}` exactly as exported) on a role's `/metrics`, if it
/// is there.
pub async fn gauge(port: u16, series: &str) -> Option<f64> {
    let r = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?;
    let text = r.text().await.ok()?;
    text.lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(s, _)| *s == series)
        .and_then(|(_, v)| v.parse().ok())
}

/// `seckill <args>` configured for this test (schema, key prefix, env name).
pub fn command(env: &TestEnv, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__ENV", &env.settings.env)
        .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
        .env("SECKILL__REDIS__KEY_PREFIX", &env.settings.redis.key_prefix)
        .env("SECKILL__REDIS__MODE", redis_mode(&env.settings))
        .env(
            "SECKILL__REDIS__URL",
            secrecy::ExposeSecret::expose_secret(&env.settings.redis.url),
        );
    cmd
}

/// `redis.mode` as the configuration spells it.
fn redis_mode(settings: &Settings) -> &'static str {
    match settings.redis.mode {
        seckill::config::RedisMode::Standalone => "standalone",
        seckill::config::RedisMode::Cluster => "cluster",
    }
}

/// The seed nodes of the test Redis Cluster (`scripts/redis-cluster-up.sh`, started by
/// `make services-up`), or `SECKILL_TEST_REDIS_CLUSTER`.
pub fn cluster_seeds() -> String {
    std::env::var("SECKILL_TEST_REDIS_CLUSTER").unwrap_or_else(|_| {
        "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003".into()
    })
}

impl TestEnv {
    /// This environment with its Redis on the test cluster instead of the one server.
    pub fn on_redis_cluster(mut self) -> Self {
        self.settings.redis.mode = seckill::config::RedisMode::Cluster;
        self.settings.redis.url = cluster_seeds().into();
        self.settings
            .validate()
            .expect("cluster settings are valid");
        self
    }
}

/// Runs a one-shot command (dlq, reconcile, ...) to completion and returns its output.
pub fn cli(env: &TestEnv, args: &[&str]) -> std::process::Output {
    command(env, args).output().expect("binary runs")
}

/// [`cli`] without blocking the test's runtime, for a command that waits on work done by
/// consumers running in the test itself (their handlers run on this runtime).
pub async fn cli_async(env: &TestEnv, args: &[&str]) -> std::process::Output {
    tokio::process::Command::from(command(env, args))
        .output()
        .await
        .expect("binary runs")
}

/// Asserts a role's `/metrics` exposes every name within 20 s (a gauge sampled from the
/// broker appears at the role's first sample that reads it).
pub async fn assert_metrics(url: &str, names: &[&str]) {
    let started = std::time::Instant::now();
    loop {
        let text = reqwest::get(url).await.unwrap().text().await.unwrap();
        let missing: Vec<&&str> = names.iter().filter(|n| !text.contains(**n)).collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{url} lacks {missing:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Waits until `url` answers 2xx.
pub async fn wait_ready(url: String) {
    eventually(30, &url.clone(), || {
        let url = url.clone();
        async move {
            reqwest::get(&url)
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false)
        }
    })
    .await;
}

/// The roles of a sale, each on its own ports and ready: `api`, `scan`, `consume --workers 2`.
pub struct SaleRoles {
    pub api: Proc,
    pub api_port: u16,
    pub scan: Proc,
    pub consume: Proc,
}

impl SaleRoles {
    pub async fn start(env: &TestEnv) -> Self {
        let (api, api_port) = spawn_listening(env, &["api"], "SECKILL__API__LISTEN", &[]);
        let (scan, scan_port) =
            spawn_listening(env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
        let (consume, consume_port) = spawn_listening(
            env,
            &["consume", "--workers", "2"],
            "SECKILL__CONSUMER__METRICS_LISTEN",
            &[],
        );
        for port in [api_port, scan_port, consume_port] {
            wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
        }
        Self {
            api,
            api_port,
            scan,
            consume,
        }
    }

    /// SIGTERM to each, the consumer given the longest to drain.
    pub async fn stop(mut self) {
        let _ = self.api.terminate(20).await;
        let _ = self.scan.terminate(20).await;
        let _ = self.consume.terminate(40).await;
    }
}

/// One reservation attempt in Redis exactly as the API makes it (the buyer's home bucket, ids
/// minted first), without sending; the first re-send is due in `next_retry_in_ms`.
pub async fn try_reserve(
    redis: &RedisStore,
    activity_id: i64,
    user_id: i64,
    request_id: &str,
    next_retry_in_ms: i64,
) -> (Ids, seckill::redis::ReserveResult) {
    let bucket = redis.home_shard(activity_id, user_id).await.unwrap().bucket;
    let ids = Ids::generate(activity_id, bucket);
    let now = Utc::now().timestamp_millis();
    let r = redis
        .reserve(&seckill::redis::ReserveArgs {
            reservation: seckill::domain::order_create::ReservationRef {
                message_id: &ids.message_id,
                request_id,
                reservation_id: &ids.reservation_id,
                order_id: &ids.order_id,
                activity_id,
                sku_id: 1,
                user_id,
            },
            now_ms: now,
            next_retry_at_ms: now + next_retry_in_ms,
            traceparent: "",
            valid_secs: 300,
            limits: Default::default(),
            channel: "",
            pass_id: "",
        })
        .await
        .unwrap();
    (ids, r)
}

/// Reserves in Redis exactly as the API does, without sending (as if the process died
/// right after the script); the first re-send is due in `next_retry_in_ms`.
pub async fn reserve_only(
    redis: &RedisStore,
    activity_id: i64,
    user_id: i64,
    next_retry_in_ms: i64,
) -> Ids {
    let request_id = format!("req-{user_id}");
    let (ids, r) = try_reserve(redis, activity_id, user_id, &request_id, next_retry_in_ms).await;
    assert!(
        matches!(r, seckill::redis::ReserveResult::Reserved(_)),
        "{r:?}"
    );
    ids
}

/// A loopback TCP proxy to `upstream` that can stop forwarding: from the client's side, a
/// dependency that hangs (the connection stays open, nothing comes back).
pub struct StallProxy {
    pub addr: std::net::SocketAddr,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let upstream = upstream.to_string();
        let flag = stalled.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Self::pump(cr, sw, flag.clone()));
                tokio::spawn(Self::pump(sr, cw, flag.clone()));
            }
        });
        Self {
            addr,
            stalled,
            accept,
        }
    }

    /// Holds every byte (`true`) or forwards again, the held ones first (`false`).
    pub fn stall(&self, on: bool) {
        self.stalled.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        stalled: Arc<std::sync::atomic::AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while stalled.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The API served in-process on a free loopback port, with the real broker publisher.
pub struct Api {
    pub addr: std::net::SocketAddr,
    /// `http://<addr>`.
    pub base: String,
    /// `http://<ops addr>`: its /metrics, /healthz, /readyz (`api.metrics_listen`).
    pub ops: String,
    pub ready: seckill::telemetry::Readiness,
    /// Cancel to stop it (it drains its requests first).
    pub stop: tokio_util::sync::CancellationToken,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts the API with `settings` and waits until `/readyz` answers 200.
pub async fn start_api(settings: Settings) -> Api {
    let publisher = seckill::mq::connect_publisher(&settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(settings), publisher)
        .await
        .expect("api state");
    let ready = state.ready.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ops = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ops_base = format!("http://{}", ops.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let listeners = seckill::roles::api::Listeners {
        buyers: listener,
        ops: Some(ops),
        admin: None,
    };
    let server = tokio::spawn(seckill::roles::api::serve_listeners(
        listeners,
        state,
        stop.clone(),
    ));
    let base = format!("http://{addr}");
    wait_ready(format!("{base}/readyz")).await;
    Api {
        addr,
        base,
        ops: ops_base,
        ready,
        stop,
        server,
    }
}

/// The API with its admin listener: the buyers' and the admin base URLs, and its stop.
pub struct AdminApi {
    pub base: String,
    pub admin: String,
    pub stop: tokio_util::sync::CancellationToken,
}

/// One call to an admin route, with `Authorization: Bearer <token>` when given and `body` as
/// JSON: the status and the JSON body (`Null` when there is none).
pub async fn admin_call(
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut req = reqwest::Client::new().request(method, url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// The stable code of a JSON error answer (`{"error": {"code": ...}}`).
pub fn error_code(body: &serde_json::Value) -> Option<&str> {
    body["error"]["code"].as_str()
}

/// Starts the API of `env` with an admin listener guarded by `token`.
pub async fn start_with_admin(env: &TestEnv, token: &str) -> AdminApi {
    let mut settings = env.settings.clone();
    settings.api.admin_token = secrecy::SecretString::from(token.to_string());
    let publisher = seckill::mq::connect_publisher(&settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(settings), publisher)
        .await
        .unwrap();
    let buyers = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", buyers.local_addr().unwrap());
    let admin_base = format!("http://{}", admin.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let listeners = seckill::roles::api::Listeners {
        buyers,
        ops: None,
        admin: Some(admin),
    };
    tokio::spawn(seckill::roles::api::serve_listeners(
        listeners,
        state,
        stop.clone(),
    ));
    wait_ready(format!("{base}/readyz")).await;
    AdminApi {
        base,
        admin: admin_base,
        stop,
    }
}

/// `POST /v1/activities/{activity}/skus/{sku}/reservations` as buyer `user` (its development
/// token), with `request_id`: the status and the JSON body.
pub async fn reserve_as(
    base: &str,
    activity: i64,
    sku: i64,
    user: i64,
    request_id: &str,
) -> (reqwest::StatusCode, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/{sku}/reservations"
        ))
        .header("authorization", bearer(user))
        .json(&serde_json::json!({"user_id": user, "request_id": request_id, "quantity": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// The test configuration's development secrets, loaded once.
fn test_settings() -> &'static Settings {
    static SETTINGS: std::sync::OnceLock<Settings> = std::sync::OnceLock::new();
    SETTINGS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        Settings::load_from(&dir).expect("config loads")
    })
}

/// The test configuration's Redis (the one server, not the cluster).
pub fn plain_redis_url() -> String {
    secrecy::ExposeSecret::expose_secret(&test_settings().redis.url).to_string()
}

/// `Authorization` value of buyer `user`: a development token of the test configuration.
pub fn bearer(user: i64) -> String {
    let s = test_settings();
    let spec = seckill::auth::buyer::TokenSpec {
        user_id: user,
        ttl: Duration::from_secs(3600),
        audience: &s.auth.audience,
        issuer: &s.auth.issuer,
    };
    let token = seckill::auth::buyer::mint_dev(&s.auth.dev_hs256_secret, &spec).expect("mint");
    format!("Bearer {token}")
}

/// Posts a payment notification for `order_id` signed the way the provider signs it (with the
/// test configuration's first webhook secret, now).
pub async fn notify_payment(
    base: &str,
    order_id: &str,
    payment_id: &str,
    amount_cents: i64,
) -> (reqwest::StatusCode, serde_json::Value) {
    let body = serde_json::json!({
        "order_id": order_id, "payment_id": payment_id, "amount_cents": amount_cents,
    })
    .to_string();
    let secret = &test_settings().payments.webhook_secrets[0];
    let sig = seckill::auth::signature::sign(secret, Utc::now().timestamp(), body.as_bytes());
    post_notification(base, &body, Some(&sig)).await
}

/// Posts a payment notification body with this `Seckill-Signature` (or none).
pub async fn post_notification(
    base: &str,
    body: &str,
    signature: Option<&str>,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/payments/notifications"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(sig) = signature {
        req = req.header("seckill-signature", sig);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// Orders of `activity_id` SKU 1 for `users`, reserved in Redis exactly as the API does, then
/// created by the order consumer's handler (no broker involved).
pub async fn created_orders(env: &TestEnv, activity_id: i64, users: &[i64]) -> Vec<Ids> {
    let redis = env.redis().await;
    let names = seckill::mq::Names::of(&env.settings);
    let handler = seckill::roles::consume::order_create::OrderCreateHandler::new(
        env.pool(2).await,
        &env.settings,
        1,
    );
    let mut out = Vec::new();
    for &user in users {
        let ids = reserve_only(&redis, activity_id, user, 600_000).await;
        let now = Utc::now().timestamp_millis();
        let fields = redis
            .reservation(activity_id, &ids.reservation_id)
            .await
            .unwrap();
        let event = seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
        handler
            .process(&[delivery_of(&names.order_create_topic, &event)])
            .await
            .unwrap();
        redis
            .mark_sent(activity_id, &ids.reservation_id, &ids.message_id, "b", now)
            .await
            .unwrap();
        out.push(ids);
    }
    out
}

/// Every message of the order-event topic, as a consumer gets it.
#[derive(Default)]
pub struct Collector(std::sync::Mutex<Vec<Delivery>>);

#[async_trait::async_trait]
impl seckill::mq::BatchHandler for Collector {
    async fn handle(&self, batch: Vec<Delivery>) -> seckill::mq::ConsumeDecision {
        self.0.lock().unwrap().extend(batch);
        seckill::mq::ConsumeDecision::Ack
    }
}

impl Collector {
    /// The ORDER_PAID copies of `order_id` delivered so far.
    pub fn paid(&self, order_id: &str) -> Vec<Delivery> {
        self.tagged("ORDER_PAID", order_id)
    }

    /// The copies of `order_id`'s events tagged `tag` delivered so far.
    pub fn tagged(&self, tag: &str, order_id: &str) -> Vec<Delivery> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.tags == tag && d.keys == order_id)
            .cloned()
            .collect()
    }
}

/// A consumer group of its own on the order-event topic.
pub async fn collect_events(
    env: &TestEnv,
) -> (
    Arc<Collector>,
    seckill::mq::rocketmq::ConsumerHandle,
    String,
) {
    let group = format!("CG_{}_EVENT_COLLECTOR", env.settings.env);
    let spec = seckill::roles::ops::topics::tool_group(&env.settings, &group);
    seckill::mq::create_groups(&env.settings, &[spec])
        .await
        .expect("the collector's group");
    let collector = Arc::new(Collector::default());
    let handle = seckill::mq::start_consumer(
        &env.settings,
        &group,
        &seckill::mq::Names::of(&env.settings).order_event_topic,
        collector.clone(),
        2,
        16,
    )
    .await
    .unwrap();
    (collector, handle, group)
}

/// `seckill reconcile` over the last hour with no grace, failing on drift: what a test that
/// just made the drift looks at.
pub fn reconcile_now() -> seckill::roles::ops::reconcile::ReconcileArgs {
    seckill::roles::ops::reconcile::ReconcileArgs {
        window_hours: 1,
        grace_secs: 0,
        json: false,
        fail_on_drift: true,
        metrics_file: None,
    }
}
