//! The pgbench scripts that `bench/limits/limits.sh` measures the order consumer against must run
//! the consumer's own statements in the consumer's order, or the ratios in BENCHMARKS.md
//! compare different work. This test puts a recording proxy between the consumer and
//! PostgreSQL, lets the real handler create orders (a batch of one, then a full batch), and
//! compares the statements it executed, in order, with the scripts' statements.

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use crate::common::{delivery_of, event, TestEnv};
use seckill::mq::{BatchHandler, ConsumeDecision};
use seckill::roles::consume::order_create::OrderCreateHandler;
use secrecy::ExposeSecret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A loopback proxy to PostgreSQL that records, in order, every statement the client has the
/// server execute: the text of each simple query, and the prepared text behind each Bind.
struct RecordingProxy {
    port: u16,
    executed: Arc<Mutex<Vec<String>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl RecordingProxy {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let executed = Arc::new(Mutex::new(Vec::new()));
        let log = executed.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                let (cr, mut cw) = client.into_split();
                let (mut sr, sw) = server.into_split();
                tokio::spawn(Self::record(sw, cr, log.clone()));
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
            }
        });
        Self {
            port,
            executed,
            accept,
        }
    }

    /// Forwards the client's bytes unchanged and parses them as frontend messages.
    async fn record(
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut from: tokio::net::tcp::OwnedReadHalf,
        log: Arc<Mutex<Vec<String>>>,
    ) {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut started = false;
        let mut prepared: std::collections::HashMap<String, String> = Default::default();
        loop {
            let n = match from.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if to.write_all(&chunk[..n]).await.is_err() {
                return;
            }
            buf.extend_from_slice(&chunk[..n]);
            loop {
                // The startup message has no type byte; every later message has one.
                let head = if started { 1 } else { 0 };
                if buf.len() < head + 4 {
                    break;
                }
                let len = u32::from_be_bytes(buf[head..head + 4].try_into().unwrap()) as usize;
                if buf.len() < head + len {
                    break;
                }
                let msg: Vec<u8> = buf.drain(..head + len).collect();
                if !started {
                    started = true;
                    continue;
                }
                let body = &msg[5..];
                let mut fields = body.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f));
                match msg[0] {
                    b'P' => {
                        let name = fields.next().unwrap_or_default().into_owned();
                        let query = fields.next().unwrap_or_default().into_owned();
                        prepared.insert(name, query);
                    }
                    b'B' => {
                        let _portal = fields.next();
                        let name = fields.next().unwrap_or_default().into_owned();
                        let query = prepared.get(&name).cloned().unwrap_or(name);
                        log.lock().unwrap().push(query);
                    }
                    b'Q' => {
                        let query = fields.next().unwrap_or_default().into_owned();
                        log.lock().unwrap().push(query);
                    }
                    _ => {}
                }
            }
        }
    }
}

impl Drop for RecordingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// What a statement does, for comparison: its verb and the table it works on (`INSERT
/// consumer_inbox`, `SELECT activity_skus`, `SAVEPOINT`, ...), schema names dropped.
fn shape(sql: &str) -> String {
    let words: Vec<String> = sql
        .replace(['(', ')', ',', ';'], " ")
        .split_whitespace()
        .map(|w| {
            let w = w.rsplit('.').next().unwrap_or(w);
            w.to_string()
        })
        .collect();
    let upper = |i: usize| {
        words
            .get(i)
            .map(|w| w.to_ascii_uppercase())
            .unwrap_or_default()
    };
    match upper(0).as_str() {
        "INSERT" => format!("INSERT {}", words.get(2).cloned().unwrap_or_default()),
        "UPDATE" => format!("UPDATE {}", words.get(1).cloned().unwrap_or_default()),
        "DELETE" => format!("DELETE {}", words.get(2).cloned().unwrap_or_default()),
        // tokio-postgres opens a transaction with START TRANSACTION; pgbench scripts say BEGIN.
        "START" if upper(1) == "TRANSACTION" => "BEGIN".into(),
        "SELECT" => {
            // The first real table after FROM or JOIN (not unnest(...) or generate_series(...)).
            let table = words.windows(2).find_map(|w| {
                let kw = w[0].to_ascii_uppercase();
                let t = w[1].to_ascii_lowercase();
                ((kw == "FROM" || kw == "JOIN") && t != "unnest" && t != "generate_series")
                    .then_some(t)
            });
            format!("SELECT {}", table.unwrap_or_default())
        }
        verb => verb.to_string(),
    }
}

/// The statements of a pgbench script, in order (comments and meta-commands left out).
fn script_shapes(file: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("bench/limits")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let sql: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("--") && !l.trim_start().starts_with('\\'))
        .collect::<Vec<_>>()
        .join("\n");
    sql.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(shape)
        .collect()
}

/// The statements one call of the consumer's handler executed, from its BEGIN to its COMMIT.
async fn consumer_shapes(env: &TestEnv, batch: usize) -> Vec<String> {
    let cfg = tokio_postgres::Config::from_str(env.settings.pg.url.expose_secret()).unwrap();
    let upstream = match (cfg.get_hosts().first(), cfg.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Tcp(h)), port) => {
            format!("{h}:{}", port.copied().unwrap_or(5432))
        }
        other => panic!("the tests' PostgreSQL is not a TCP host: {other:?}"),
    };
    let proxy = RecordingProxy::start(upstream).await;
    let mut pg = env.settings.pg.clone();
    pg.url = format!(
        "host=127.0.0.1 port={} user={} dbname={}",
        proxy.port,
        cfg.get_user().unwrap_or("postgres"),
        cfg.get_dbname().unwrap_or("postgres")
    )
    .into();
    let pool = seckill::pg::connect_pool(&pg, 2).await.unwrap();
    let handler = OrderCreateHandler::new(pool, &env.settings, 1);
    let topic = env.names().order_create_topic;
    // A first batch warms the connection (prepared statements, settings), as in a running
    // consumer; the second is the one compared.
    for round in 0..2 {
        let deliveries: Vec<_> = (0..batch)
            .map(|i| {
                delivery_of(
                    &topic,
                    &event(1, 1, (batch * 10_000 + round * 1000 + i + 1) as i64, 300),
                )
            })
            .collect();
        proxy.executed.lock().unwrap().clear();
        assert_eq!(handler.handle(deliveries).await, ConsumeDecision::Ack);
    }
    let executed: Vec<String> = proxy
        .executed
        .lock()
        .unwrap()
        .iter()
        .map(|q| shape(q))
        .collect();
    let begin = executed
        .iter()
        .position(|q| q == "BEGIN")
        .unwrap_or_else(|| panic!("no BEGIN in {executed:#?}"));
    let commit = executed
        .iter()
        .rposition(|q| q == "COMMIT")
        .unwrap_or_else(|| panic!("no COMMIT in {executed:#?}"));
    executed[begin..=commit].to_vec()
}

#[tokio::test]
async fn the_pgbench_order_scripts_run_the_consumers_statements_in_its_order() {
    let env = TestEnv::without_topics().await;
    env.activity(1, 1, 1_000).await;
    let single = consumer_shapes(&env, 1).await;
    // The consumer's happy path, as docs/architecture/order-creation.md#order-creation describes
    // it: the hot row's lock is the last thing the transaction takes, followed only by the commit
    // stamp.
    assert_eq!(
        single[single.len().saturating_sub(3)..],
        ["UPDATE stock_buckets", "INSERT order_commits", "COMMIT"],
        "{single:#?}"
    );
    assert_eq!(script_shapes("order_single.sql"), single);

    let batch_size = env.settings.consumer.batch_size;
    let batch = consumer_shapes(&env, batch_size).await;
    assert_eq!(script_shapes("order_batch.sql"), batch);
    // bench/limits/limits.sh runs order_batch.sql with the consumer's configured batch size
    // (SECKILL__CONSUMER__BATCH_SIZE over config/default.toml, as the settings read it; no
    // overlay of the tests changes it).
    let limits = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/limits/limits.sh");
    let out = std::process::Command::new("bash")
        .arg(&limits)
        .arg("--batch-size")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        batch_size.to_string(),
        "limits.sh would batch another number of orders than the consumer"
    );
    env.cleanup().await;
}

/// The limits schema is built from the project's migrations, every one of them: a migration
/// left out would make the pgbench scripts run against a different schema than the consumer.
#[test]
fn the_limits_schema_includes_every_migration() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let schema = std::fs::read_to_string(root.join("bench/limits/schema.sql")).unwrap();
    let mut migrations: Vec<String> = std::fs::read_dir(root.join("sql"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('V') && n.ends_with(".sql"))
        .collect();
    migrations.sort();
    assert!(!migrations.is_empty());
    for m in &migrations {
        assert!(
            schema.contains(&format!("\\ir ../../sql/{m}")),
            "bench/limits/schema.sql does not include sql/{m}"
        );
    }
}

#[test]
fn shapes_name_the_verb_and_the_table() {
    assert_eq!(
        shape("INSERT INTO seckill_limits.consumer_inbox (a) VALUES (1)"),
        "INSERT consumer_inbox"
    );
    assert_eq!(
        shape("SELECT t.a FROM unnest($1::int8[]) AS t(a) JOIN activity_skus k ON true"),
        "SELECT activity_skus"
    );
    assert_eq!(
        shape("UPDATE consumer_inbox i SET x = 1"),
        "UPDATE consumer_inbox"
    );
    assert_eq!(shape("NOTIFY seckill_outbox"), "NOTIFY");
    assert_eq!(shape("SAVEPOINT stock"), "SAVEPOINT");
    assert_eq!(shape("START TRANSACTION"), "BEGIN");
}
