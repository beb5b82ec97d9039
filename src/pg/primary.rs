//! Which PostgreSQL server is the primary, as each role sees it
//! (docs/architecture/postgresql.md#failover).
//!
//! With several hosts in `pg.url` and `target_session_attrs=read-write`, tokio-postgres opens
//! every new connection on whichever host accepts writes: after a manager promotes the standby,
//! the pools follow by themselves. What nothing did was *notice*. Each role now reads, once a
//! `pg.primary_check_ms`, the address and port of the server its pool reaches and the timeline
//! that server writes on (a promotion starts a new one). A change of either after the first
//! reading is a failover seen: `pg_failovers_seen_total` counts it, `pg_primary{host}` and
//! `pg_timeline` say where the role writes now, and the role's subscribers
//! ([`Failovers::changed`]) act on it at once (the scanner checks every confirmed send it
//! still watches: docs/architecture/recovery.md#after-a-postgresql-failover).

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Where a role's connections write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primary {
    /// `address:port` as the server itself reports it (`inet_server_addr`, `inet_server_port`;
    /// `socket` for a Unix socket).
    pub host: String,
    /// The timeline of the WAL the server writes now: a promoted standby starts a new one.
    pub timeline: u32,
}

/// Whether the server commits on a synchronous standby (`synchronous_standby_names` set: each
/// commit waits for the standby's flush, so a failover to it keeps what was answered).
pub async fn has_sync_standby(
    client: &impl tokio_postgres::GenericClient,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT current_setting('synchronous_standby_names') <> ''",
            &[],
        )
        .await?
        .get(0))
}

/// Reads the server's address, port and current timeline.
pub async fn read(client: &tokio_postgres::Client) -> Result<Primary, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT coalesce(host(inet_server_addr()), 'socket') || ':'
                    || coalesce(inet_server_port(), 0)::text,
                    ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8",
            &[],
        )
        .await?;
    Ok(Primary {
        host: row.get(0),
        timeline: u32::try_from(row.get::<_, i64>(1)).unwrap_or(0),
    })
}

/// What one reading means against the one before (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The first reading of this process.
    First,
    Same,
    /// Another server, or the same one on a later timeline.
    Failover {
        from: Primary,
    },
}

/// The change from `last` to `now` (pure). A timeline going *back* on the same host is a
/// restore, not something a failover does; it is reported as a failover all the same, as
/// the watch's repairs are what an operator wants after either.
pub fn change(last: Option<&Primary>, now: &Primary) -> Change {
    match last {
        None => Change::First,
        Some(l) if l == now => Change::Same,
        Some(l) => Change::Failover { from: l.clone() },
    }
}

/// How many failovers this process has seen; subscribers wait for the count to move.
#[derive(Clone)]
pub struct Failovers {
    rx: watch::Receiver<u64>,
    /// The sender of a count that never moves ([`Failovers::none`]), kept so that `changed`
    /// waits instead of ending.
    _still: Option<std::sync::Arc<watch::Sender<u64>>>,
}

impl Failovers {
    /// Failovers seen so far.
    pub fn seen(&self) -> u64 {
        *self.rx.borrow()
    }

    /// Waits until another failover is seen; returns the new count (`None` once the watch has
    /// stopped).
    pub async fn changed(&mut self) -> Option<u64> {
        self.rx.changed().await.ok()?;
        Some(*self.rx.borrow_and_update())
    }

    /// A count that never moves (a role or test without a watch).
    pub fn none() -> Self {
        let (tx, rx) = watch::channel(0);
        Failovers {
            rx,
            _still: Some(std::sync::Arc::new(tx)),
        }
    }
}

/// Publishes `now` as the primary (and `from` as no longer it).
fn publish(now: &Primary, from: Option<&Primary>) {
    if let Some(from) = from.filter(|f| f.host != now.host) {
        metrics::gauge!("pg_primary", "host" => from.host.clone()).set(0.0);
    }
    metrics::gauge!("pg_primary", "host" => now.host.clone()).set(1.0);
    metrics::gauge!("pg_timeline").set(f64::from(now.timeline));
}

/// Reads the primary every `every` from `pool` until `stop`; returns the failover count its
/// subscribers watch.
pub fn spawn(pool: deadpool_postgres::Pool, every: Duration, stop: CancellationToken) -> Failovers {
    let (tx, rx) = watch::channel(0u64);
    metrics::counter!("pg_failovers_seen_total").increment(0);
    tokio::spawn(async move {
        let mut last: Option<Primary> = None;
        loop {
            match reading(&pool).await {
                Ok(now) => match change(last.as_ref(), &now) {
                    Change::Same => {}
                    Change::First => {
                        info!(host = %now.host, timeline = now.timeline, "PostgreSQL primary");
                        publish(&now, None);
                        last = Some(now);
                    }
                    Change::Failover { from } => {
                        warn!(
                            from_host = %from.host,
                            from_timeline = from.timeline,
                            host = %now.host,
                            timeline = now.timeline,
                            "PostgreSQL failover seen: writes now go to another primary"
                        );
                        metrics::counter!("pg_failovers_seen_total").increment(1);
                        publish(&now, Some(&from));
                        last = Some(now);
                        tx.send_modify(|n| *n += 1);
                    }
                },
                // A failover in progress, or the database down: the next reading tells.
                Err(e) => tracing::debug!(error = %e, "PostgreSQL primary unreadable"),
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(every) => {}
            }
        }
    });
    Failovers { rx, _still: None }
}

async fn reading(pool: &deadpool_postgres::Pool) -> anyhow::Result<Primary> {
    let client = pool.get().await?;
    Ok(read(&client).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(host: &str, timeline: u32) -> Primary {
        Primary {
            host: host.into(),
            timeline,
        }
    }

    #[test]
    fn a_new_host_or_a_new_timeline_is_a_failover_the_same_server_is_not() {
        assert_eq!(change(None, &p("127.0.0.1:5441", 1)), Change::First);
        let a = p("127.0.0.1:5441", 1);
        assert_eq!(change(Some(&a), &a.clone()), Change::Same);
        assert_eq!(
            change(Some(&a), &p("127.0.0.1:5442", 2)),
            Change::Failover { from: a.clone() }
        );
        // Promoted in place behind one address (a virtual IP, a proxy): only the timeline moves.
        assert_eq!(
            change(Some(&a), &p("127.0.0.1:5441", 2)),
            Change::Failover { from: a.clone() }
        );
    }
}
