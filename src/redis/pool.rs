//! The Redis connection pool, with every wait bounded: connecting
//! (`redis.connect_timeout_ms`), each command's answer (`redis.response_timeout_ms`), and the
//! wait for a pooled connection (`redis.pool_wait_timeout_ms`). A Redis that hangs then fails
//! each call within those bounds instead of hanging every request and `/readyz`
//! (docs/architecture/hot-path.md#hung-dependencies). deadpool-redis's own manager connects without
//! any of these; this one differs from it in that, and in speaking to Redis Cluster too
//! (`redis.mode = "cluster"`, docs/architecture/redis.md#redis-cluster).

use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleResult};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::cluster::{ClusterClient, ClusterClientBuilder};
use deadpool_redis::redis::cluster_async::ClusterConnection;
use deadpool_redis::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use deadpool_redis::redis::{
    self, AsyncConnectionConfig, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture,
    RedisResult, Value,
};
use deadpool_redis::{Runtime, Timeouts};

use crate::config::{RedisMode, RedisSettings};

/// How a pooled connection is made.
enum Connector {
    Standalone {
        client: redis::Client,
        config: AsyncConnectionConfig,
    },
    /// Each pooled connection is a cluster connection: one multiplexed connection per node,
    /// following the slot map (MOVED/ASK and a failover refresh it).
    Cluster(ClusterClient),
}

/// Creates connections with a connect and a response timeout.
pub struct Manager {
    connector: Connector,
    /// Where the pool connects, for messages: hosts and ports, never a password.
    endpoint: String,
}

/// One pooled connection: to the one server, or to the cluster.
#[derive(Clone)]
pub enum Conn {
    Standalone(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Standalone(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Standalone(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl Conn {
    /// One page (up to 1,000 keys) of `SCAN ... MATCH pattern` on the server that holds `slot`:
    /// the next cursor and the keys. On one server that is the whole keyspace; on a cluster,
    /// the primary serving the slot (a pattern under one hash tag lives there whole).
    pub async fn scan_page(
        &mut self,
        slot: u16,
        cursor: u64,
        pattern: &str,
    ) -> RedisResult<(u64, Vec<String>)> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        match self {
            Conn::Standalone(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => {
                let route = Route::new(slot, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                redis::from_redis_value(&c.route_command(&cmd, routing).await?)
            }
        }
    }
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag (the text between the
/// first `{` and the next `}`, when not empty), else of the whole key, modulo 16384.
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(bytes)) % 16384
}

impl managed::Manager for Manager {
    type Type = Conn;
    type Error = RedisError;

    async fn create(&self) -> Result<Conn, RedisError> {
        match &self.connector {
            Connector::Standalone { client, config } => Ok(Conn::Standalone(
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
            )),
            Connector::Cluster(client) => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }

    async fn recycle(&self, conn: &mut Conn, _: &Metrics) -> RecycleResult<RedisError> {
        let _: String = redis::cmd("PING").query_async(conn).await?;
        Ok(())
    }
}

pub type Pool = managed::Pool<Manager>;

/// Where the pool connects, for messages: hosts and ports, never the password.
pub fn endpoint(pool: &Pool) -> String {
    pool.manager().endpoint.clone()
}

/// The server's certificate authorities for a `rediss://` URL: `redis.ca_file`, or the
/// system's roots (docs/architecture/security.md#secrets).
fn tls_certificates(settings: &RedisSettings) -> anyhow::Result<redis::TlsCertificates> {
    crate::tls::install_crypto_provider();
    let root_cert =
        if settings.ca_file.is_empty() {
            None
        } else {
            Some(std::fs::read(&settings.ca_file).map_err(|e| {
                anyhow::anyhow!("redis.ca_file: cannot read {}: {e}", settings.ca_file)
            })?)
        };
    Ok(redis::TlsCertificates {
        client_tls: None,
        root_cert,
    })
}

/// Builds the pool (no connection yet: the caller checks the server answers).
pub fn build(settings: &RedisSettings) -> anyhow::Result<Pool> {
    // The client's own errors could quote the URL, password included: say what is wrong only.
    let urls = settings.urls();
    let tls = urls.iter().any(|u| u.starts_with("rediss://"));
    let mut addrs = Vec::with_capacity(urls.len());
    for url in &urls {
        let info = url
            .into_connection_info()
            .map_err(|_| anyhow::anyhow!("redis.url: not a valid Redis URL"))?;
        addrs.push(info.addr.to_string());
    }
    let connect = Duration::from_millis(settings.connect_timeout_ms);
    let response = Duration::from_millis(settings.response_timeout_ms);
    let connector = match settings.mode {
        RedisMode::Standalone => {
            let url = urls[0];
            let client = if tls {
                redis::Client::build_with_tls(url, tls_certificates(settings)?)
                    .map_err(|_| anyhow::anyhow!("redis.url: not a valid Redis URL or CA file"))?
            } else {
                redis::Client::open(url)
                    .map_err(|_| anyhow::anyhow!("redis.url: not a valid Redis URL"))?
            };
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(connect)
                .set_response_timeout(response);
            Connector::Standalone { client, config }
        }
        RedisMode::Cluster => {
            // A command whose node moved or failed is sent again after the slot map is
            // refreshed, a few times: a failover (a replica promoted) takes about
            // cluster-node-timeout, and a caller past that gets an error it can retry.
            let mut builder = ClusterClientBuilder::new(urls.clone())
                .connection_timeout(connect)
                .response_timeout(response)
                .retries(4)
                .min_retry_wait(100)
                .max_retry_wait(1000);
            if tls {
                builder = builder.certs(tls_certificates(settings)?);
            }
            Connector::Cluster(
                builder
                    .build()
                    .map_err(|_| anyhow::anyhow!("redis.url: not a valid list of cluster nodes"))?,
            )
        }
    };
    let timeouts = Timeouts {
        wait: Some(Duration::from_millis(settings.pool_wait_timeout_ms)),
        create: Some(connect),
        recycle: Some(response),
    };
    let manager = Manager {
        connector,
        endpoint: addrs.join(","),
    };
    managed::Pool::builder(manager)
        .max_size(settings.pool_size)
        .timeouts(timeouts)
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| anyhow::anyhow!("redis: cannot build the pool: {e}"))
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_hash_tag_as_redis_cluster_does() {
        // CLUSTER KEYSLOT on a real server gives these.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        // A hash tag: only its content counts; an empty one does not count.
        assert_eq!(slot("seckill:{foo}:meta"), slot("foo"));
        assert_eq!(slot("x{foo}y{bar}"), slot("foo"));
        assert_eq!(slot("{}foo"), 9500);
        assert_eq!(slot("foo{"), 7673);
        assert_eq!(slot("seckill:{a982}:meta"), 11903);
    }
}
