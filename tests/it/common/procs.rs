//! The real binary as a child process: one role, a one-shot command, or a sale's three roles.

use std::time::{Duration, Instant};

use super::*;

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
    // A role logs to stdout: both streams go to the file a failing test keeps.
    let out = file.try_clone().expect("the log file, twice");
    cmd.env("FAILPOINTS", failpoints).stdout(out).stderr(file);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().expect("binary starts"), Some(log))
}

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

/// `seckill consume --workers <workers>` serving /metrics and /readyz on a free port (returned).
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

/// `seckill <args>` configured for this test (schema, key prefix, env name).
pub fn command(env: &TestEnv, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__ENV", &env.settings.env)
        .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
        .env(
            "SECKILL__PG__URL",
            secrecy::ExposeSecret::expose_secret(&env.settings.pg.url),
        )
        .env("SECKILL__REDIS__KEY_PREFIX", &env.settings.redis.key_prefix)
        .env("SECKILL__REDIS__MODE", redis_mode(&env.settings))
        .env(
            "SECKILL__REDIS__URL",
            secrecy::ExposeSecret::expose_secret(&env.settings.redis.url),
        );
    cmd
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

/// The roles of a sale, each on its own ports and ready: `api`, `scan`, `consume --workers 2`.
pub struct SaleRoles {
    pub api: Proc,
    pub api_port: u16,
    pub scan: Proc,
    pub consume: Proc,
}

impl SaleRoles {
    pub async fn start(env: &TestEnv) -> Self {
        let api = Role::api().spawn(env);
        let scan = Role::scan().spawn(env);
        let consume = Role::consume(2).spawn(env);
        ready([&api, &scan, &consume]).await;
        Self {
            api_port: api.port,
            api: api.proc,
            scan: scan.proc,
            consume: consume.proc,
        }
    }

    /// SIGTERM to each, the consumer given the longest to drain.
    pub async fn stop(mut self) {
        let _ = self.api.terminate(20).await;
        let _ = self.scan.terminate(20).await;
        let _ = self.consume.terminate(40).await;
    }
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

/// Reconcile's `stock_drift` right now: asserts there is none (what every fault test ends on).
pub async fn assert_no_stock_drift(env: &TestEnv) {
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let report = seckill::roles::ops::reconcile::reconcile(
        &env.settings,
        &**client,
        &env.redis().await,
        &reconcile_now(),
    )
    .await
    .unwrap();
    let drift: usize = report
        .findings
        .iter()
        .filter(|f| f.kind == "stock_drift")
        .map(|f| f.found)
        .sum();
    assert_eq!(drift, 0, "{:?}", report.findings);
}
