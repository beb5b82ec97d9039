//! PostgreSQL on a core of its own for the crowd's steps, as on its own machine: its processes
//! on the last core, this run (and every process it starts from now on: the roles, the direct
//! server, the load generators), Redis and the broker on the others. Both designs are then
//! measured with the same CPU for the database. Undone at the end of the scenario.

use tokio::process::Command;

/// What was pinned, to undo it.
pub struct Pinning {
    all: String,
    /// Shown on the lines: `postgres=1 rest=0`.
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

async fn taskset(cpus: &str, pids: &[String]) -> anyhow::Result<()> {
    for pid in pids {
        // -a: every thread; a process that exited meanwhile is not an error.
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", cpus, pid])
            .output()
            .await?;
    }
    Ok(())
}

/// Everything but PostgreSQL: this process, Redis, the name servers and brokers.
async fn the_rest() -> Vec<String> {
    let mut out = vec![std::process::id().to_string()];
    out.extend(pids(&["-x", "redis-server"]).await);
    out.extend(pids(&["-f", "rocketmq-(broker|namesrv)-rust"]).await);
    out
}

impl Pinning {
    /// Pins PostgreSQL to the last core and the rest to the others; `None` on a machine with
    /// one core (nothing to share out).
    pub async fn apply() -> anyhow::Result<Option<Pinning>> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores < 2 {
            return Ok(None);
        }
        let pg_core = (cores - 1).to_string();
        let rest = if cores == 2 {
            "0".to_owned()
        } else {
            format!("0-{}", cores - 2)
        };
        taskset(&pg_core, &pids(&["-x", "postgres"]).await).await?;
        taskset(&rest, &the_rest().await).await?;
        Ok(Some(Pinning {
            all: format!("0-{}", cores - 1),
            label: format!("postgres_cpus={pg_core} rest_cpus={rest}"),
        }))
    }

    /// Every core for everyone again (PostgreSQL's backends started meanwhile included).
    pub async fn undo(self) {
        let mut all = pids(&["-x", "postgres"]).await;
        all.extend(the_rest().await);
        let _ = taskset(&self.all, &all).await;
    }
}
