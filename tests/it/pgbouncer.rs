//! PgBouncer in front of PostgreSQL (docs/RUNNING.md#pgbouncer), with the shipped configuration
//! (deploy/pgbouncer/pgbouncer.ini) and only its port, pool mode and authentication changed for
//! the test: a whole sale through it in session pooling mode, judged as a sale without it is,
//! and a pooler in transaction mode refused by the roles at start-up, naming the reason.

use std::path::{Path, PathBuf};

use crate::common::{self, eventually, free_port, spawn_listening, wait_ready, Proc, TestEnv};

/// A PgBouncer of this test's own, in the foreground, in front of the shared PostgreSQL.
struct PgBouncer {
    proc: Proc,
    port: u16,
    dir: PathBuf,
}

impl PgBouncer {
    /// Starts PgBouncer from the shipped configuration with `pool_mode` and a free port, and
    /// waits until it answers.
    async fn start(pool_mode: &str) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("seckill-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).expect("a directory for PgBouncer");
        // PgBouncer refuses to run as root: it drops to the postgres user, which must read
        // its files and write its log.
        set_mode(&dir, 0o777);
        let users = dir.join("userlist.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n\"root\" \"\"\n").unwrap();
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(&ini, configuration(port, pool_mode, &users)).unwrap();
        let log = dir.join("pgbouncer.log");
        let mut cmd = std::process::Command::new("pgbouncer");
        if running_as_root() {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(&ini)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("pgbouncer runs (make services-up installs it)");
        let bouncer = Self {
            proc: Proc(child, Some(log)),
            port,
            dir,
        };
        let url = bouncer.url();
        eventually(15, "PgBouncer answers", || {
            let url = url.clone();
            async move {
                let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                else {
                    return false;
                };
                tokio::spawn(conn);
                client.simple_query("SELECT 1").await.is_ok()
            }
        })
        .await;
        bouncer
    }

    /// The roles' `pg.url` through this PgBouncer.
    fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// The client connections PgBouncer holds now, by `application_name` (its admin console).
    async fn clients(&self) -> Vec<String> {
        let admin = format!(
            "host=127.0.0.1 port={} user=postgres dbname=pgbouncer",
            self.port
        );
        let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
            .await
            .expect("PgBouncer's admin console");
        tokio::spawn(conn);
        let rows = client.simple_query("SHOW CLIENTS").await.unwrap();
        rows.iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r
                    .try_get("application_name")
                    .ok()
                    .flatten()
                    .map(str::to_owned),
                _ => None,
            })
            .collect()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.proc.0.kill();
        let _ = self.proc.0.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The shipped configuration with the test's port, pool mode and trust authentication (the
/// shared PostgreSQL trusts loopback), and its admin console open to `postgres`.
fn configuration(port: u16, pool_mode: &str, users: &Path) -> String {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/pgbouncer/pgbouncer.ini");
    let text = std::fs::read_to_string(shipped).expect("deploy/pgbouncer/pgbouncer.ini");
    let overrides = [
        ("listen_port", port.to_string()),
        ("pool_mode", pool_mode.to_string()),
        ("auth_type", "trust".to_string()),
        ("auth_file", users.display().to_string()),
    ];
    let mut out: Vec<String> = text
        .lines()
        .map(|line| {
            let key = line.split('=').next().unwrap_or("").trim();
            match overrides.iter().find(|(k, _)| *k == key) {
                Some((k, v)) => format!("{k} = {v}"),
                None => line.to_string(),
            }
        })
        .collect();
    for (k, _) in &overrides {
        assert!(
            out.iter().any(|l| l.starts_with(&format!("{k} = "))),
            "the shipped pgbouncer.ini sets {k}"
        );
    }
    // The [pgbouncer] section is the file's last: these join it.
    out.push("admin_users = postgres".into());
    out.push("unix_socket_dir =".into());
    out.join("\n") + "\n"
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Seconds a buyer has to pay: short, so the unpaid orders expire during the test.
const PAY_WINDOW: &str = "6";

#[tokio::test]
async fn a_sale_through_pgbouncer_in_session_mode_keeps_every_invariant() {
    let env = TestEnv::with_topics().await;
    let bouncer = PgBouncer::start("session").await;
    let url = bouncer.url();
    let via = [("SECKILL__PG__URL", url.as_str())];
    // The schema is migrated already; migrate through PgBouncer finds nothing to do.
    let out = common::command(&env, &["migrate"])
        .env("SECKILL__PG__URL", &url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    env.activity(7700, 1, 40).await;
    let roles = [
        (&["api"][..], "SECKILL__API__LISTEN"),
        (
            &["consume", "--workers", "2"][..],
            "SECKILL__CONSUMER__METRICS_LISTEN",
        ),
        (&["scan"][..], "SECKILL__SCAN__METRICS_LISTEN"),
        (&["timeout-cancel"][..], "SECKILL__TIMEOUT__METRICS_LISTEN"),
    ];
    let mut procs: Vec<(Proc, u16)> = Vec::new();
    for (args, listen) in roles {
        let extra = [via[0], ("SECKILL__CONSUMER__PAY_WINDOW_SECS", PAY_WINDOW)];
        procs.push(spawn_listening(&env, args, listen, &extra));
    }
    for (_, port) in &procs {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }
    // Every role's connections are PgBouncer's clients, not PostgreSQL's directly.
    let clients = bouncer.clients().await;
    for role in ["api", "consume", "scan", "timeout-cancel"] {
        let name = format!(
            "seckill-{role}@{}~s{}",
            env.settings.env,
            seckill::pg::schema_version()
        );
        assert!(
            clients.contains(&name),
            "{name} not among PgBouncer's clients: {clients:?}"
        );
    }

    common::sale::sell_pay_and_expire(&env, &[procs[0].1], 7700, 40, 100).await;

    // Reconcile through PgBouncer finds no drift.
    let out = cli_via(
        &env,
        &url,
        &["reconcile", "--grace-secs", "0", "--fail-on-drift"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for (mut p, _) in procs {
        assert!(p.terminate(40).await.success(), "a role exited non-zero");
    }
    drop(bouncer);
    env.cleanup().await;
}

#[tokio::test]
async fn the_roles_refuse_a_pooler_in_transaction_mode_at_start_up() {
    let env = TestEnv::with_topics().await;
    let bouncer = PgBouncer::start("transaction").await;
    let url = bouncer.url();
    for (args, listen) in [
        (
            &["consume", "--workers", "2"][..],
            "SECKILL__CONSUMER__METRICS_LISTEN",
        ),
        (&["api"][..], "SECKILL__API__LISTEN"),
    ] {
        let (mut p, _) = spawn_listening(&env, args, listen, &[("SECKILL__PG__URL", &url)]);
        let status = p.wait_exit(60).await;
        assert!(
            !status.success(),
            "{args:?} started through a transaction-mode pool"
        );
        let log = std::fs::read_to_string(p.1.as_ref().unwrap()).unwrap();
        assert!(
            log.contains("do not keep their server session between transactions")
                && log.contains("pool_mode = transaction"),
            "{args:?} exited without naming the pool mode:\n{log}"
        );
    }
    // A one-shot command too: its own SET statement_timeout would outlive its transaction on
    // whichever server ran it.
    let out = cli_via(&env, &url, &["reconcile", "--grace-secs", "0"]);
    assert!(
        !out.status.success(),
        "reconcile ran through a transaction-mode pool"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("pool_mode = transaction"), "{stderr}");
    drop(bouncer);
    env.cleanup().await;
}

/// A one-shot `seckill` command whose PostgreSQL is at `url`.
fn cli_via(env: &TestEnv, url: &str, args: &[&str]) -> std::process::Output {
    common::command(env, args)
        .env("SECKILL__PG__URL", url)
        .output()
        .expect("binary runs")
}
