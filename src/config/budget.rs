//! The worker budgets (docs/architecture/order-creation.md#worker-budget: how many order and cancel
//! transactions one process runs at once) and the connection budget
//! (docs/architecture/order-creation.md#connection-budget): every PostgreSQL pool each role opens,
//! from the same numbers the roles size them with, times each role's instance count, against
//! `pg.max_connections`. Each role checks it at start-up (exit 2 naming `pg.max_connections` when
//! the fleet would open more); `seckill budget` prints it.

use serde::Serialize;

use super::{ConfigError, PgSettings, Settings};

/// Pools of a fixed size: the roles open exactly these.
pub mod pools {
    /// `consume`: the DLQ intake's pool (all its groups).
    pub const DLQ_INTAKE: usize = 2;
    /// `scan`: the outbox relay's pool.
    pub const SCAN_RELAY: usize = 2;
    /// `scan`: the relay's LISTEN connection (woken by the writers' NOTIFY).
    pub const SCAN_RELAY_LISTEN: usize = 1;
    /// `scan`: the reservation scanner's settle pool.
    pub const SCAN_SCANNER: usize = 1;
    /// `scan`: retention's pool.
    pub const SCAN_RETENTION: usize = 1;
    /// `scan`: the Redis rebuilds' pool (an advisory lock's, a rebuild's and a fence's
    /// connections at once).
    pub const SCAN_REBUILD: usize = 4;
}

/// One pool of a role: its name and size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pool {
    pub name: &'static str,
    pub connections: usize,
}

/// One role's pools, per instance, and its instances.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolePools {
    pub role: &'static str,
    /// The key that states its instance count.
    pub instances_key: &'static str,
    pub instances: u32,
    pub pools: Vec<Pool>,
    pub per_instance: usize,
    pub total: usize,
    /// Its share of `pg.max_connections`.
    pub share: f64,
}

/// The whole fleet's connections.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConnectionBudget {
    pub roles: Vec<RolePools>,
    /// `pg.operator_connections`: kept for one-shot commands.
    pub operators: u32,
    pub total: usize,
    pub max_connections: u32,
}

/// The worker budget (docs/architecture/order-creation.md#worker-budget): order transactions one
/// `consume` process runs at once, `pg.safe_concurrency × pg.order_share / pg.consume_instances`,
/// at least 1.
pub fn order_budget(pg: &PgSettings) -> usize {
    budget(pg.safe_concurrency, pg.order_share, pg.consume_instances())
}

/// Timeout-cancel transactions one `timeout-cancel` process runs at once:
/// `pg.safe_concurrency × pg.cancel_share / pg.timeout_cancel_instances`, at least 1.
pub fn cancel_budget(pg: &PgSettings) -> usize {
    budget(
        pg.safe_concurrency,
        pg.cancel_share,
        pg.timeout_cancel_instances(),
    )
}

/// `safe_concurrency × share / instances` (e.g. 240 × 0.7 / 12 = 14), floor, ≥ 1.
pub fn budget(safe_concurrency: u32, share: f64, instances: u32) -> usize {
    let raw = f64::from(safe_concurrency) * share / f64::from(instances.max(1));
    (raw.floor() as usize).max(1)
}

/// The order-create pool of one `consume` process: its worker budget and one connection for
/// the batches' bookkeeping outside it.
pub fn consume_order_pool(pg: &PgSettings) -> usize {
    order_budget(pg) + 1
}

/// The pool of one `timeout-cancel` process: its cancel budget and one for the sweep.
pub fn timeout_cancel_pool(pg: &PgSettings) -> usize {
    cancel_budget(pg) + 1
}

fn pool(name: &'static str, connections: usize) -> Pool {
    Pool { name, connections }
}

impl Settings {
    /// Every pool of every role, as configured.
    pub fn connection_budget(&self) -> ConnectionBudget {
        use pools::*;
        let pg = &self.pg;
        let roles = [
            (
                "api",
                "pg.api_instances",
                pg.api_instances,
                vec![pool("api", pg.api_pool_size)],
            ),
            (
                "consume",
                "pg.consume_instances",
                pg.consume_instances(),
                vec![
                    pool("order_create", consume_order_pool(pg)),
                    pool("dlq_intake", DLQ_INTAKE),
                    pool("compensation", self.consumer.compensate_workers),
                    pool("projection", self.consumer.projection_workers),
                    pool("audit", self.consumer.audit_workers),
                ],
            ),
            (
                "timeout-cancel",
                "pg.timeout_cancel_instances",
                pg.timeout_cancel_instances(),
                vec![pool("cancel", timeout_cancel_pool(pg))],
            ),
            (
                "scan",
                "pg.scan_instances",
                pg.scan_instances,
                vec![
                    pool("relay", SCAN_RELAY),
                    pool("relay_listen", SCAN_RELAY_LISTEN),
                    pool("scanner", SCAN_SCANNER),
                    pool("retention", SCAN_RETENTION),
                    pool("rebuild", SCAN_REBUILD),
                ],
            ),
        ];
        let max = pg.max_connections;
        let roles: Vec<RolePools> = roles
            .into_iter()
            .map(|(role, instances_key, instances, pools)| {
                let per_instance = pools.iter().map(|p| p.connections).sum::<usize>();
                let total = per_instance * instances as usize;
                RolePools {
                    role,
                    instances_key,
                    instances,
                    pools,
                    per_instance,
                    total,
                    share: total as f64 / f64::from(max.max(1)),
                }
            })
            .collect();
        let total = roles.iter().map(|r| r.total).sum::<usize>() + pg.operator_connections as usize;
        ConnectionBudget {
            roles,
            operators: pg.operator_connections,
            total,
            max_connections: max,
        }
    }
}

impl ConnectionBudget {
    /// Whether the fleet fits in `pg.max_connections`; the error names the key and the roles'
    /// figures.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.total <= self.max_connections as usize {
            return Ok(());
        }
        let parts: Vec<String> = self
            .roles
            .iter()
            .map(|r| format!("{} {} x {}", r.role, r.instances, r.per_instance))
            .chain(std::iter::once(format!("operators {}", self.operators)))
            .collect();
        Err(ConfigError::invalid(
            "pg.max_connections",
            format!(
                "the fleet opens {} connections ({}), more than pg.max_connections = {}: \
                 lower the pools or the instances, or raise it (`seckill budget` shows each pool)",
                self.total,
                parts.join(", "),
                self.max_connections
            ),
        ))
    }

    /// The table `seckill budget` prints.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<15} {:>9} {:>12} {:>6} {:>6}  pools\n",
            "role", "instances", "per instance", "total", "share"
        );
        for r in &self.roles {
            let pools: Vec<String> = r
                .pools
                .iter()
                .map(|p| format!("{}={}", p.name, p.connections))
                .collect();
            out.push_str(&format!(
                "{:<15} {:>9} {:>12} {:>6} {:>5.0}%  {}\n",
                r.role,
                r.instances,
                r.per_instance,
                r.total,
                r.share * 100.0,
                pools.join(" ")
            ));
        }
        out.push_str(&format!(
            "{:<15} {:>9} {:>12} {:>6} {:>5.0}%  pg.operator_connections\n",
            "operators",
            "-",
            "-",
            self.operators,
            f64::from(self.operators) * 100.0 / f64::from(self.max_connections.max(1))
        ));
        out.push_str(&format!(
            "fleet: {} of pg.max_connections = {} ({})\n",
            self.total,
            self.max_connections,
            if self.total <= self.max_connections as usize {
                "fits"
            } else {
                "OVER"
            }
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::test_settings;
    use super::budget;

    #[test]
    fn budget_matches_the_documented_example() {
        assert_eq!(budget(240, 0.7, 12), 14);
        assert_eq!(budget(8, 0.7, 1), 5);
        assert_eq!(budget(1, 0.1, 4), 1);
    }

    #[test]
    fn the_shipped_fleet_counts_every_pool_and_fits() {
        let s = test_settings();
        let b = s.connection_budget();
        let per: Vec<(&str, u32, usize)> = b
            .roles
            .iter()
            .map(|r| (r.role, r.instances, r.per_instance))
            .collect();
        // api 4; consume (8 x 0.7 = 5) + 1, intake 2, compensation 2, projection 2, audit 1;
        // timeout-cancel (8 x 0.25 = 2) + 1; scan 2 + 1 + 1 + 1 + 4.
        assert_eq!(
            per,
            [
                ("api", 1, 4),
                (
                    "consume",
                    1,
                    6 + 2
                        + s.consumer.compensate_workers
                        + s.consumer.projection_workers
                        + s.consumer.audit_workers
                ),
                ("timeout-cancel", 1, 3),
                ("scan", 1, 9),
            ]
        );
        let roles: usize = b.roles.iter().map(|r| r.total).sum();
        assert_eq!(b.total, roles + s.pg.operator_connections as usize);
        assert!(b.check().is_ok(), "{}", b.table());
        assert!(b.table().contains("fits"));
    }

    #[test]
    fn a_fleet_over_max_connections_fails_naming_the_key() {
        let mut s = test_settings();
        s.pg.consume_instances_key = Some(4);
        // Four consumers split the worker budget: each has 8 x 0.7 / 4 = 1 (+1) connections.
        let consume = |s: &super::Settings| {
            s.connection_budget()
                .roles
                .iter()
                .find(|r| r.role == "consume")
                .unwrap()
                .pools[0]
                .connections
        };
        assert_eq!(consume(&s), 2);
        s.pg.api_instances = 30;
        let b = s.connection_budget();
        let err = b.check().unwrap_err().to_string();
        assert!(err.contains("`pg.max_connections`"), "{err}");
        assert!(err.contains("api 30 x 4"), "{err}");
        assert!(b.table().contains("OVER"));
        s.pg.max_connections = b.total as u32;
        assert!(s.connection_budget().check().is_ok());
    }
}
