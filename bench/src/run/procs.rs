//! The processes a `make bench` run starts and stops: the roles (`seckill api`, `consume`,
//! `scan`), the direct-PostgreSQL baseline, and one-shot commands whose last line is a
//! scenario's result. Every role's output goes to its log in the run directory; every role
//! started is stopped (SIGTERM, then SIGKILL after 30 s), on success or failure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

use crate::ratios::Line;

/// The roles and commands of one run.
pub struct Procs {
    /// The `seckill` binary.
    pub seckill: PathBuf,
    /// This binary (`seckill-bench`).
    pub bench: PathBuf,
    /// Logs, outputs and each scenario's line.
    pub dir: PathBuf,
    /// The nice level of the roles whose work can wait (consume, scan, timeout-cancel), as
    /// deploy/systemd ships them (docs/architecture/roles.md#scheduling-weights).
    pub waiting_nice: i32,
    /// Variables every process of the run gets (the JWKS the servers verify with, the key the
    /// generators sign with), before the scenario's overrides.
    pub base_env: Vec<(String, String)>,
    /// `SECKILL__…` overrides given to every process started while they are set.
    env: Vec<(String, String)>,
    running: BTreeMap<String, Child>,
    next_activity: i64,
}

impl Procs {
    pub fn new(seckill: PathBuf, dir: PathBuf, waiting_nice: i32) -> anyhow::Result<Self> {
        let bench = std::env::current_exe().context("locating seckill-bench")?;
        std::fs::create_dir_all(&dir)?;
        let now = chrono::Utc::now().timestamp();
        Ok(Procs {
            seckill,
            bench,
            dir,
            waiting_nice,
            base_env: Vec::new(),
            env: Vec::new(),
            running: BTreeMap::new(),
            next_activity: now * 100,
        })
    }

    /// Sets `SECKILL__…` overrides for every process started from now on.
    pub fn set_env(&mut self, vars: &[(&str, &str)]) {
        self.env = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }

    fn command(&self, bin: &Path, nice: Option<i32>) -> Command {
        let mut cmd = match nice {
            Some(n) if n != 0 => {
                let mut c = Command::new("nice");
                c.arg("-n").arg(n.to_string()).arg(bin);
                c
            }
            _ => Command::new(bin),
        };
        cmd.envs(self.base_env.iter().map(|(k, v)| (k, v)));
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.kill_on_drop(true);
        cmd
    }

    /// Starts role `name` (`seckill <args>`); consume and scan at the waiting roles' nice level
    /// unless `nice` says otherwise.
    pub fn start(&mut self, name: &str, args: &[&str], nice: Option<i32>) -> anyhow::Result<()> {
        let nice = nice.or(match name {
            "consume" | "scan" | "timeout-cancel" => Some(self.waiting_nice),
            _ => None,
        });
        let bin = self.seckill.clone();
        self.start_bin(name, &bin, args, nice)
    }

    /// Starts the direct-PostgreSQL baseline server (`seckill-bench baseline-api <args>`).
    pub fn start_baseline(&mut self, args: &[String]) -> anyhow::Result<()> {
        let bin = self.bench.clone();
        let mut all = vec!["baseline-api".to_owned()];
        all.extend_from_slice(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        self.start_bin("baseline", &bin, &all, None)
    }

    fn start_bin(
        &mut self,
        name: &str,
        bin: &Path,
        args: &[&str],
        nice: Option<i32>,
    ) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))?;
        let child = self
            .command(bin, nice)
            .args(args)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.running.insert(name.to_owned(), child);
        Ok(())
    }

    /// Restarts `seckill consume` (with the current overrides) and waits for its queues.
    pub async fn restart_consume(&mut self) -> anyhow::Result<()> {
        self.stop("consume").await;
        self.start("consume", &["consume"], None)?;
        wait_ready(super::CONSUME_READY).await?;
        // Queue assignment.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it has not exited within 30 s.
    pub async fn stop(&mut self, name: &str) {
        let Some(mut child) = self.running.remove(name) else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }

    /// A running role's pid.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.running.get(name)?.id()
    }

    pub async fn stop_all(&mut self) {
        let names: Vec<String> = self.running.keys().cloned().collect();
        for name in names {
            self.stop(&name).await;
        }
    }

    /// `--cpu name=pid` for every running role, the broker, PostgreSQL (its postmaster: its
    /// backends are counted as its children) and Redis.
    pub async fn cpu_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, child) in &self.running {
            if let Some(pid) = child.id() {
                out.extend(["--cpu".to_owned(), format!("{name}={pid}")]);
            }
        }
        for (name, args) in [
            ("broker", &["-d+", "-f", "rocketmq-broker-rust"][..]),
            ("postgres", &["-o", "-x", "postgres"][..]),
            ("redis", &["-d+", "-x", "redis-server"][..]),
        ] {
            let found = Command::new("pgrep").args(args).output().await;
            if let Ok(o) = found {
                let pids = String::from_utf8_lossy(&o.stdout).trim().to_owned();
                if !pids.is_empty() {
                    out.extend(["--cpu".to_owned(), format!("{name}={pids}")]);
                }
            }
        }
        out
    }

    /// An activity id no activity of this run has (the direct server's activities are only
    /// ids).
    pub fn fresh_id(&mut self) -> i64 {
        self.next_activity += 1;
        self.next_activity
    }

    /// A fresh activity with `skus` SKUs of `stock` units each; its id.
    pub async fn activity(&mut self, stock: i64, skus: usize) -> anyhow::Result<i64> {
        self.activity_with(stock, skus, &[]).await
    }

    /// The same with `extra` arguments to `seckill activity create` (a start, a fair window,
    /// passes).
    pub async fn activity_with(
        &mut self,
        stock: i64,
        skus: usize,
        extra: &[String],
    ) -> anyhow::Result<i64> {
        let id = self.fresh_id();
        let mut args = vec![
            "activity".to_owned(),
            "create".to_owned(),
            "--activity-id".to_owned(),
            id.to_string(),
            "--name".to_owned(),
            "bench".to_owned(),
            "--duration-secs".to_owned(),
            "3600".to_owned(),
        ];
        for sku in 1..=skus {
            args.extend(["--sku".to_owned(), format!("{sku}:{stock}:9900")]);
        }
        args.extend_from_slice(extra);
        let seckill = self.seckill.clone();
        let status = self
            .command(&seckill, None)
            .args(&args)
            .stdout(Stdio::null())
            .status()
            .await?;
        anyhow::ensure!(status.success(), "seckill activity create {id} failed");
        Ok(id)
    }

    /// Runs `seckill-bench <args>`; its output is kept in `<out>.out` and its last line is the
    /// scenario's result.
    pub async fn bench_line(&self, out: &str, args: &[String]) -> anyhow::Result<Line> {
        let bench = self.bench.clone();
        let output = self
            .command(&bench, None)
            .args(args)
            .stderr(Stdio::inherit())
            .output()
            .await
            .with_context(|| format!("running seckill-bench {}", args.join(" ")))?;
        let text = String::from_utf8_lossy(&output.stdout);
        std::fs::write(self.dir.join(format!("{out}.out")), text.as_bytes())?;
        let last = text.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
        let line = Line::parse(last);
        eprintln!("[bench] {}", line.text);
        Ok(line)
    }
}

impl Procs {
    /// pgbench's batch alone (`bench/limits/limits.sh` with `LIMITS_ONLY=batch`, from the
    /// repository's root as `scripts/bench.sh` runs this): its `LIMITS ...` line, the floor of
    /// the drain that follows it. Its output is kept in `<out>.out`. `batch_size` is the
    /// consumer's `consumer.batch_size` as the run's settings resolve it (every file and
    /// variable the roles read), handed to limits.sh so both sides batch alike.
    pub async fn pgbench_batch(&self, out: &str, batch_size: usize) -> anyhow::Result<Line> {
        let output = Command::new("bench/limits/limits.sh")
            .env("LIMITS_ONLY", "batch")
            .env("SECKILL__CONSUMER__BATCH_SIZE", batch_size.to_string())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .output()
            .await
            .context("running bench/limits/limits.sh (LIMITS_ONLY=batch)")?;
        let text = String::from_utf8_lossy(&output.stdout);
        std::fs::write(self.dir.join(format!("{out}.out")), text.as_bytes())?;
        anyhow::ensure!(
            output.status.success(),
            "bench/limits/limits.sh (LIMITS_ONLY=batch) failed: {}",
            output.status
        );
        let line = text
            .lines()
            .rfind(|l| l.starts_with("LIMITS "))
            .context("no LIMITS line from bench/limits/limits.sh")?;
        eprintln!("[bench] {line}");
        Ok(Line::parse(line))
    }
}

/// Waits up to 30 s for `url` to answer 2xx.
pub async fn wait_ready(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("{url} not ready after 30 s (logs in the run directory)")
}

/// Polls `check` every `every` until it is true or `limit` passes; whether it became true.
pub async fn poll_until<F, Fut>(limit: Duration, every: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if check().await {
            return true;
        }
        if started.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}
