//! The integration tests, one binary (one link of the whole crate instead of one per file):
//! one module per area, each against the real PostgreSQL, Redis and RocketMQ; `common` is
//! what they share. `cargo test --test it <module>::` runs one area. A test that sets a
//! failpoint inside the test process (global to the process, not keyed by its own message)
//! belongs in `tests/isolated/`, apart from the tests whose code paths it would disturb.

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

mod activity;
mod admin;
mod archive;
mod audit_stream;
mod broker_disk;
mod cancel_tx;
mod config;
mod connection_budget;
mod delivery;
mod dlq;
mod failover_sweep;
#[cfg(feature = "failpoints")]
mod fair_start;
mod fast_lane;
mod faults;
mod front_door;
mod hung_dependencies;
mod jwks_url;
mod many_instances;
mod metrics;
mod order_plans;
mod order_tx;
mod outbox_timers;
mod partitions_by_day;
mod passes;
mod pg_failover;
mod pgbench_scripts;
mod pgbouncer;
mod pipeline;
mod plan;
mod rate_limits;
mod rebuild_under_sale;
mod reconcile;
mod recovery;
mod redis_cluster;
mod redis_loss;
mod redis_loss_faults;
mod refunds;
mod retention;
mod roles;
mod rolling_restart;
mod sale_faults;
mod schema;
mod slow_clients;
mod sold_out;
mod source_replay;
mod tls;
mod trust;
#[cfg(feature = "failpoints")]
mod uncertain_send;
mod upgrade;
