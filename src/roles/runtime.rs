//! What every background role (`consume`, `scan`, `timeout-cancel`) does around its own work:
//! the ops listener (`/metrics`, `/healthz`, `/readyz`), readiness, the [`Watchdog`] over its
//! loops, and the stop (docs/architecture/roles.md#graceful-shutdown). The API's stop has a drain
//! delay and listeners of its own (`roles::api::serve_listeners`).

use std::net::SocketAddr;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::shutdown::Watchdog;
use crate::telemetry::Readiness;

/// One running role's ops listener, readiness and watchdog.
pub struct RoleRuntime {
    /// `/readyz`: set once the role takes work, cleared when it stops.
    pub ready: Readiness,
    /// Cancelled when the role's loops must end.
    pub shutdown: CancellationToken,
    /// Watches the role's background loops: one that dies stops the role.
    pub watchdog: Watchdog,
    role: &'static str,
    ops: JoinHandle<()>,
}

impl RoleRuntime {
    /// Binds the ops listener on `addr` (a port that cannot be bound fails start-up naming
    /// `key`); the role is not ready until [`RoleRuntime::serving`].
    pub async fn start(role: &'static str, key: &str, addr: SocketAddr) -> anyhow::Result<Self> {
        let ready = Readiness::default();
        let shutdown = CancellationToken::new();
        let ops = crate::telemetry::serve_ops(key, addr, ready.clone(), shutdown.clone()).await?;
        let watchdog = Watchdog::new(shutdown.clone(), ready.clone());
        Ok(Self {
            ready,
            shutdown,
            watchdog,
            role,
            ops,
        })
    }

    /// Watches which PostgreSQL server `pool` writes to, until the role stops
    /// (docs/architecture/postgresql.md#failover).
    pub fn watch_primary(
        &self,
        pool: &deadpool_postgres::Pool,
        pg: &crate::config::PgSettings,
    ) -> crate::pg::primary::Failovers {
        crate::pg::primary::spawn(
            pool.clone(),
            std::time::Duration::from_millis(pg.primary_check_ms),
            self.shutdown.clone(),
        )
    }

    /// The role takes work: ready from now on.
    pub fn serving(&self) {
        self.ready.set(true);
    }

    /// Waits for SIGINT/SIGTERM (`None`) or a dead loop (`Some(reason)`), then turns not
    /// ready: the role stops taking work and drains what it holds.
    pub async fn stop_requested(&self) -> Option<String> {
        let died = self.watchdog.stop_requested().await;
        self.ready.set(false);
        died
    }

    /// After the drain: ends the loops and the ops listener; a dead loop is the role's error.
    pub async fn finish(self, died: Option<String>) -> anyhow::Result<()> {
        self.ready.set(false);
        self.shutdown.cancel();
        let _ = self.ops.await;
        info!("{} stopped", self.role);
        match died {
            Some(reason) => Err(anyhow::anyhow!(reason)),
            None => Ok(()),
        }
    }
}
