//! TLS to PostgreSQL and Redis is a config switch (docs/architecture/security.md#secrets): with it
//! on, the connection is encrypted and the server's certificate is checked, CA and name.

use std::path::Path;
use std::time::Duration;

use crate::common::{free_port, TestEnv};
use seckill::config::PgTls;
use seckill::redis::{RedisStore, ReserveResult};

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
        .display()
        .to_string()
}

#[tokio::test]
async fn postgresql_over_tls_is_encrypted_and_the_server_name_is_checked() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let plain = pool.get().await.unwrap();
    let ssl = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    let on: bool = plain.query_one(ssl, &[]).await.unwrap().get(0);
    assert!(!on, "pg.tls = off: a plain connection");
    // The server's own certificate (self-signed, for `localhost`) is the CA to trust.
    let cert_file: String = plain
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .unwrap()
        .get(0);
    let mut settings = env.settings.pg.clone();
    settings.tls = PgTls::Verify;
    settings.ca_file = cert_file;
    settings.url = "host=localhost port=5432 user=postgres dbname=postgres"
        .to_string()
        .into();
    let tls_pool = seckill::pg::connect_pool(&settings, 1)
        .await
        .expect("TLS to localhost, verified against the server's certificate");
    let c = tls_pool.get().await.unwrap();
    let on: bool = c.query_one(ssl, &[]).await.unwrap().get(0);
    assert!(on, "pg.tls = verify: the connection is encrypted");
    // The same certificate does not name 127.0.0.1: the connection is refused.
    settings.url = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
        .to_string()
        .into();
    let err = seckill::pg::connect_pool(&settings, 1).await.err().unwrap();
    assert!(format!("{err:#}").contains("pg.url"), "{err:#}");
    // A CA that did not sign it: refused too.
    settings.url = "host=localhost port=5432 user=postgres dbname=postgres"
        .to_string()
        .into();
    settings.ca_file = fixture("ca.pem");
    assert!(seckill::pg::connect_pool(&settings, 1).await.is_err());
    drop((c, plain));
    env.cleanup().await;
}

/// A Redis serving TLS only, with the fixture certificate for 127.0.0.1.
struct TlsRedis {
    child: std::process::Child,
    port: u16,
    _dir: std::path::PathBuf,
}

impl TlsRedis {
    async fn start() -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("seckill-tls-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--tls-cert-file", &fixture("server.pem")])
            .args(["--tls-key-file", &fixture("server.key")])
            .args(["--tls-ca-cert-file", &fixture("ca.pem")])
            .args([
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--dir", &dir.display().to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server");
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

#[tokio::test]
async fn redis_over_tls_reserves_and_an_unknown_ca_is_refused() {
    let env = TestEnv::without_topics().await;
    let server = TlsRedis::start().await;
    let mut settings = env.settings.redis.clone();
    settings.url = format!("rediss://127.0.0.1:{}", server.port).into();
    settings.ca_file = fixture("ca.pem");
    let redis = RedisStore::connect(&settings)
        .await
        .expect("rediss:// with the CA that signed the server");
    let now = chrono::Utc::now().timestamp_millis();
    redis
        .stock()
        .warm(1300, 1, now - 1000, now + 600_000, 300_000, 3, 1)
        .await
        .unwrap();
    let ids = seckill::domain::Ids::generate(1300, 0);
    let r = redis
        .intake()
        .reserve(&seckill::redis::ReserveArgs {
            reservation: seckill::domain::order_create::ReservationRef {
                message_id: &ids.message_id,
                request_id: "tls-1",
                reservation_id: &ids.reservation_id,
                order_id: &ids.order_id,
                activity_id: 1300,
                sku_id: 1,
                user_id: 1,
            },
            now_ms: now,
            next_retry_at_ms: now + 60_000,
            traceparent: "",
            valid_secs: 300,
            limits: Default::default(),
            channel: "",
            pass_id: "",
        })
        .await
        .unwrap();
    assert!(matches!(r, ReserveResult::Reserved(_)), "{r:?}");
    assert_eq!(
        redis.stock().sku_stock(1300, 1).await.unwrap(),
        Some((3, 2))
    );
    // Trusting only the system's roots, the test CA's server is refused.
    settings.ca_file = String::new();
    assert!(RedisStore::connect(&settings).await.is_err());
    // Plain text to the TLS port gets nowhere either.
    settings.url = format!("redis://127.0.0.1:{}", server.port).into();
    assert!(RedisStore::connect(&settings).await.is_err());
    drop(server);
    env.cleanup().await;
}
