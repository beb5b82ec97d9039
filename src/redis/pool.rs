//! The Redis connection pool, with every wait bounded: connecting
//! (`redis.connect_timeout_ms`), each command's answer (`redis.response_timeout_ms`), and the
//! wait for a pooled connection (`redis.pool_wait_timeout_ms`). A Redis that hangs then fails
//! each call within those bounds instead of hanging every request and `/readyz`
//! (docs/ARCHITECTURE.md#hung-dependencies). deadpool-redis's own manager connects without
//! any of these; this one differs from it only in that.

use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleResult};
use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::{self, AsyncConnectionConfig, RedisError};
use deadpool_redis::{Runtime, Timeouts};

use secrecy::ExposeSecret;

use crate::config::RedisSettings;

/// Creates multiplexed connections with a connect and a response timeout.
pub struct Manager {
    client: redis::Client,
    config: AsyncConnectionConfig,
}

impl managed::Manager for Manager {
    type Type = MultiplexedConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<MultiplexedConnection, RedisError> {
        self.client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
    }

    async fn recycle(
        &self,
        conn: &mut MultiplexedConnection,
        _: &Metrics,
    ) -> RecycleResult<RedisError> {
        let _: String = redis::cmd("PING").query_async(conn).await?;
        Ok(())
    }
}

pub type Pool = managed::Pool<Manager>;

/// Where the pool connects, for messages: host and port, never the password.
pub fn endpoint(pool: &Pool) -> String {
    pool.manager().client.get_connection_info().addr.to_string()
}

/// Builds the pool (no connection yet: the caller checks the server answers).
pub fn build(settings: &RedisSettings) -> anyhow::Result<Pool> {
    // The client's own errors could quote the URL, password included: say what is wrong only.
    let url = settings.url.expose_secret();
    let client = if url.starts_with("rediss://") {
        // TLS (docs/ARCHITECTURE.md#secrets): the server checked against redis.ca_file, or
        // the system's roots.
        crate::tls::install_crypto_provider();
        let root_cert = if settings.ca_file.is_empty() {
            None
        } else {
            Some(std::fs::read(&settings.ca_file).map_err(|e| {
                anyhow::anyhow!("redis.ca_file: cannot read {}: {e}", settings.ca_file)
            })?)
        };
        let certs = redis::TlsCertificates {
            client_tls: None,
            root_cert,
        };
        redis::Client::build_with_tls(url, certs)
            .map_err(|_| anyhow::anyhow!("redis.url: not a valid Redis URL or CA file"))?
    } else {
        redis::Client::open(url).map_err(|_| anyhow::anyhow!("redis.url: not a valid Redis URL"))?
    };
    let connect = Duration::from_millis(settings.connect_timeout_ms);
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(connect)
        .set_response_timeout(Duration::from_millis(settings.response_timeout_ms));
    let timeouts = Timeouts {
        wait: Some(Duration::from_millis(settings.pool_wait_timeout_ms)),
        create: Some(connect),
        recycle: Some(Duration::from_millis(settings.response_timeout_ms)),
    };
    managed::Pool::builder(Manager { client, config })
        .max_size(settings.pool_size)
        .timeouts(timeouts)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| anyhow::anyhow!("redis: cannot build the pool: {e}"))
}
