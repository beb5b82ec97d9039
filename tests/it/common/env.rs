//! A test's own world: its PostgreSQL schema, Redis key prefix and environment name (so its own
//! topics and consumer groups), and what it reads of them.

use std::path::Path;
use std::time::Duration;

use chrono::Utc;
use seckill::config::Settings;
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
        self.settings.names().clone()
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

    /// [`TestEnv::with_topics`] on another PostgreSQL (`url`: a failover pair's hosts).
    pub async fn with_topics_on(url: &str) -> Self {
        Self::build(true, Some(url)).await
    }

    async fn new(with_topics: bool) -> Self {
        Self::build(with_topics, None).await
    }

    async fn build(with_topics: bool, pg_url: Option<&str>) -> Self {
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
        if let Some(url) = pg_url {
            settings.pg.url = url.to_owned().into();
        }
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
                .stock()
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

    /// Drops the schema, the Redis keys, the archive and the topics of this test (a test's topics left on
    /// the shared broker pile up run after run, and a broker with thousands of topics was seen
    /// to fail its start-up registration with the name server).
    pub async fn cleanup(self) {
        let _ = std::fs::remove_dir_all(seckill::archive::Archive::of(&self.settings).root());
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

impl TestEnv {
    /// Invariants 1, 2, 3, 5 and 6 for one activity SKU of this test.
    pub async fn invariants(&self, activity_id: i64, sku_id: i64) -> seckill::invariants::Report {
        let pool = self.pool(1).await;
        let client = pool.get().await.unwrap();
        seckill::invariants::check(
            &**client,
            &self.redis().await,
            &self.settings.names().order_create_group,
            activity_id,
            sku_id,
        )
        .await
        .unwrap()
    }
}

/// `redis.mode` as the configuration spells it.
pub(super) fn redis_mode(settings: &Settings) -> &'static str {
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

/// The test configuration's development secrets, loaded once.
pub(super) fn test_settings() -> &'static Settings {
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
