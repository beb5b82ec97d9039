//! PostgreSQL's CPU held the same for both designs during the crowd's steps, as on a machine
//! of its own: its processes go into a cgroup whose CPU quota is `cores` (cgroup v1 `cpu` or
//! v2 `cpu.max`; the backends it forks later follow it), while everything else (the roles, the
//! direct server, the load generator, Redis, the broker) shares the whole machine. The
//! database is the scarce part, as in production where it is one machine and the stateless
//! tiers are many. Where no cgroup can be written, PostgreSQL gets the last core to itself
//! (`taskset`) and the rest the other cores. Undone at the end of the scenario.

use std::path::{Path, PathBuf};

use tokio::process::Command;

/// What was done, to undo it.
pub enum Limit {
    /// PostgreSQL's processes in this cgroup (v1 `cpu` or v2), moved back to `parent`.
    Quota { dir: PathBuf, parent: PathBuf },
    /// PostgreSQL pinned to the last core, the rest to the others.
    Pinned { all: String },
}

/// The held CPU and the words the lines carry (`postgres_cpu=0.5 postgres_cpu_by=cgroup`).
pub struct PgCpu {
    limit: Limit,
    pub label: String,
}

/// The processes of a name (`pgrep <args>`).
async fn pids(args: &[&str]) -> Vec<String> {
    match Command::new("pgrep").args(args).output().await {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    }
}

async fn taskset(cpus: &str, pids: &[String]) {
    for pid in pids {
        // -a: every thread; a process that exited meanwhile is not an error.
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", cpus, pid])
            .output()
            .await;
    }
}

/// Moves `pids` into cgroup `dir` (one write per process: its threads follow).
fn move_into(dir: &Path, pids: &[String]) {
    for pid in pids {
        // A backend that exited meanwhile cannot be moved: not an error.
        let _ = std::fs::write(dir.join("cgroup.procs"), pid);
    }
}

/// A cgroup for PostgreSQL with a quota of `cores`: v2 (`cpu.max`) where the unified
/// hierarchy has the cpu controller, else v1 (`cpu.cfs_quota_us`).
fn quota_cgroup(cores: f64) -> Option<(PathBuf, PathBuf)> {
    let period = 100_000u64;
    let quota = ((cores * period as f64) as u64).max(1_000);
    let v2 = Path::new("/sys/fs/cgroup");
    let v2_cpu = std::fs::read_to_string(v2.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "cpu"));
    let (parent, file, value) = if v2_cpu {
        (v2.to_path_buf(), "cpu.max", format!("{quota} {period}"))
    } else {
        let v1 = v2.join("cpu");
        let value = quota.to_string();
        (v1, "cpu.cfs_quota_us", value)
    };
    let dir = parent.join("seckill-bench-postgres");
    let _ = std::fs::create_dir(&dir);
    std::fs::write(dir.join(file), value).ok()?;
    Some((dir, parent))
}

impl PgCpu {
    /// PostgreSQL held to `cores` of CPU; `None` on a machine with one core.
    pub async fn hold(cores: f64) -> anyhow::Result<Option<PgCpu>> {
        let machine = std::thread::available_parallelism().map_or(1, |n| n.get());
        if machine < 2 {
            return Ok(None);
        }
        let postgres = pids(&["-x", "postgres"]).await;
        if let Some((dir, parent)) = quota_cgroup(cores) {
            move_into(&dir, &postgres);
            return Ok(Some(PgCpu {
                limit: Limit::Quota { dir, parent },
                label: format!("postgres_cpu={cores} postgres_cpu_by=cgroup"),
            }));
        }
        let pg_core = (machine - 1).to_string();
        let rest = if machine == 2 {
            "0".to_owned()
        } else {
            format!("0-{}", machine - 2)
        };
        taskset(&pg_core, &postgres).await;
        let mut others = vec![std::process::id().to_string()];
        others.extend(pids(&["-x", "redis-server"]).await);
        others.extend(pids(&["-f", "rocketmq-(broker|namesrv)-rust"]).await);
        taskset(&rest, &others).await;
        Ok(Some(PgCpu {
            limit: Limit::Pinned {
                all: format!("0-{}", machine - 1),
            },
            label: format!("postgres_cpu=1 postgres_cpu_by=taskset_core_{pg_core}"),
        }))
    }

    /// PostgreSQL (its backends started meanwhile included) and the rest as they were.
    pub async fn release(self) {
        let postgres = pids(&["-x", "postgres"]).await;
        match self.limit {
            Limit::Quota { dir, parent } => {
                move_into(&parent, &postgres);
                let _ = std::fs::remove_dir(&dir);
            }
            Limit::Pinned { all } => {
                let mut every = postgres;
                every.push(std::process::id().to_string());
                every.extend(pids(&["-x", "redis-server"]).await);
                every.extend(pids(&["-f", "rocketmq-(broker|namesrv)-rust"]).await);
                taskset(&all, &every).await;
            }
        }
    }
}
