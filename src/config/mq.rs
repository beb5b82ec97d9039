//! `[mq]` and `[events]`: where the brokers are, how sends are bounded and batched, and how the
//! events PostgreSQL originates reach the broker.

use std::net::SocketAddr;

use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqSettings {
    /// The name servers, `host:port` (a name or an address), several separated by `;` as
    /// RocketMQ writes them (or `,`): the client asks the next when one does not answer.
    pub name_server: String,
    /// The master brokers topics are created on, `host:port`, comma-separated when the
    /// cluster has several (docs/architecture/messages.md#two-brokers).
    pub broker_addr: String,
    pub cluster: String,
    /// Bound on one synchronous send; past it the outcome is UNKNOWN (never a release).
    pub send_timeout_ms: u64,
    /// Client retries of a refused or unsent attempt, inside `send_timeout_ms`.
    pub send_retries: u32,
    /// Queues per topic at creation (calibrated for this machine).
    pub order_create_queues: u32,
    pub other_queues: u32,
    /// Reservations gathered into one broker call by the API (1 = one send per reservation).
    pub send_batch_max: usize,
    /// How long a batch waits for more reservations after its first, in microseconds.
    pub send_linger_us: u64,
    /// Broker calls the API has in flight at once.
    pub send_batches_in_flight: usize,
    /// The ORDER_CREATE_REQUESTED schema the API and the scanner write: 1, or 2 (adds the
    /// buyer's channel) once every consumer reads v2 (docs/architecture/postgresql.md#upgrades).
    /// Optional, so a configuration written for an earlier release still loads.
    #[serde(default = "first_schema")]
    pub order_event_schema: i32,
}

fn first_schema() -> i32 {
    crate::domain::SCHEMA_VERSION
}

impl MqSettings {
    /// Each master of `broker_addr`.
    pub fn broker_addrs(&self) -> impl Iterator<Item = &str> {
        self.broker_addr.split(',').map(str::trim)
    }

    /// Each name server of `name_server`.
    pub fn name_servers(&self) -> impl Iterator<Item = &str> {
        self.name_server
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
    }

    /// The name servers as the RocketMQ client takes them: `a:9876;b:9876`.
    pub fn name_server_list(&self) -> String {
        self.name_servers().collect::<Vec<_>>().join(";")
    }
}

/// `host:port`, the host an IP address or a DNS name (resolved when connecting).
fn is_host_port(s: &str) -> bool {
    if s.parse::<SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    port.parse::<u16>().is_ok_and(|p| p > 0)
        && host.len() <= 253
        && host.trim_end_matches('.').split('.').all(label_ok)
}

impl MqSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        let servers: Vec<&str> = self.name_servers().collect();
        if servers.is_empty() || !servers.iter().all(|s| is_host_port(s)) {
            return Err(invalid(
                "mq.name_server",
                "must be host:port (a name or an IP address; several: `a:9876;b:9876`)",
            ));
        }
        if !self.broker_addrs().all(is_host_port) {
            return Err(invalid(
                "mq.broker_addr",
                "must be host:port, a name or an IP address (several: comma-separated)",
            ));
        }
        if self.send_timeout_ms == 0 || self.send_timeout_ms > 10_000 {
            return Err(invalid("mq.send_timeout_ms", "must be in 1..=10000"));
        }
        if self.send_retries > 5 {
            return Err(invalid("mq.send_retries", "must be in 0..=5"));
        }
        if self.send_batch_max == 0 || self.send_batch_max > 256 {
            return Err(invalid("mq.send_batch_max", "must be in 1..=256"));
        }
        if self.send_linger_us > 10_000 {
            return Err(invalid(
                "mq.send_linger_us",
                "must be at most 10000 (10 ms): every reservation may wait this long",
            ));
        }
        if self.send_batches_in_flight == 0 || self.send_batches_in_flight > 64 {
            return Err(invalid("mq.send_batches_in_flight", "must be in 1..=64"));
        }
        if !(crate::domain::SCHEMA_VERSION..=crate::domain::order_create::SCHEMA_V2)
            .contains(&self.order_event_schema)
        {
            return Err(invalid(
                "mq.order_event_schema",
                "must be 1 or 2 (write 2 only once every consumer reads it)",
            ));
        }
        if self.order_create_queues == 0 || self.other_queues == 0 {
            return Err(invalid(
                "mq.order_create_queues",
                "queue counts must be positive",
            ));
        }
        Ok(())
    }
}

/// How an event PostgreSQL originates reaches the broker
/// (docs/architecture/messages.md#delivering-events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventDelivery {
    /// The event's row is written in the business transaction; the relay sends it.
    Outbox,
    /// A RocketMQ transaction message: half message, the business transaction, then commit or
    /// rollback; the broker asks back (answered from PostgreSQL) when the end does not arrive.
    Transaction,
}

impl EventDelivery {
    pub fn label(self) -> &'static str {
        match self {
            EventDelivery::Outbox => "outbox",
            EventDelivery::Transaction => "transaction",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventSettings {
    /// The delivery of every family that does not name its own.
    pub delivery: EventDelivery,
    /// ORDER_PAID, written by the payment notification.
    pub order_paid: Option<EventDelivery>,
    /// ORDER_CANCELED, written by the timeout cancel (its RELEASE_RESERVATION always goes
    /// through the outbox).
    pub order_canceled: Option<EventDelivery>,
    /// The longest a local transaction may run after its half message was stored: past it the
    /// transaction rolls back itself, which is what lets a check-back answer ROLLBACK. Must
    /// stay well below the broker's `transactionTimeout` (6000 ms in config/rocketmq).
    pub transaction_local_timeout_ms: u64,
    /// Transaction messages in flight at once per process (each holds a client thread while
    /// its local transaction runs); past it a payment waits for a slot.
    pub transaction_in_flight: usize,
    /// Check-backs answered at once per process.
    pub transaction_check_threads: u32,
    /// A row still TRANSACTION this long after it was written (its commit never reached the
    /// broker, and the broker gave up asking) is handed to the relay by `seckill reconcile`.
    pub transaction_horizon_secs: u64,
}

impl Default for EventSettings {
    fn default() -> Self {
        Self {
            delivery: EventDelivery::Outbox,
            order_paid: None,
            order_canceled: None,
            transaction_local_timeout_ms: 2_000,
            transaction_in_flight: 64,
            transaction_check_threads: 4,
            transaction_horizon_secs: 600,
        }
    }
}

impl EventSettings {
    pub fn order_paid(&self) -> EventDelivery {
        self.order_paid.unwrap_or(self.delivery)
    }
    pub fn order_canceled(&self) -> EventDelivery {
        self.order_canceled.unwrap_or(self.delivery)
    }
}

impl EventSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if !(100..=4_000).contains(&self.transaction_local_timeout_ms) {
            return Err(invalid(
                "events.transaction_local_timeout_ms",
                "must be in 100..=4000 (below the broker's 6000 ms transactionTimeout)",
            ));
        }
        if self.transaction_in_flight == 0 || self.transaction_in_flight > 1_000 {
            return Err(invalid(
                "events.transaction_in_flight",
                "must be in 1..=1000",
            ));
        }
        if self.transaction_check_threads == 0 || self.transaction_check_threads > 64 {
            return Err(invalid(
                "events.transaction_check_threads",
                "must be in 1..=64",
            ));
        }
        // The broker asks for 6 s + 60 checks x 2 s (config/rocketmq/broker.toml) before it
        // gives up: a shorter horizon would send copies of events it is still deciding.
        if self.transaction_horizon_secs < 180 {
            return Err(invalid(
                "events.transaction_horizon_secs",
                "must be at least 180 (the broker is still asking before that)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_servers_are_names_or_addresses_one_or_several() {
        assert!(is_host_port("127.0.0.1:9876"));
        assert!(is_host_port("[::1]:9876"));
        assert!(is_host_port("namesrv.internal:9876"));
        assert!(is_host_port("namesrv-a:9876"));
        for bad in [
            "namesrv", "namesrv:", ":9876", "a b:9876", "-a:9876", "host:0", "h:99999",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
        let mq = |v: &str| MqSettings {
            name_server: v.into(),
            ..super::super::tests::test_settings().mq
        };
        assert_eq!(mq("a:9876").name_server_list(), "a:9876");
        assert_eq!(mq("a:9876; b:9877").name_server_list(), "a:9876;b:9877");
        assert_eq!(mq("a:9876,b:9877,").name_server_list(), "a:9876;b:9877");
    }
}
