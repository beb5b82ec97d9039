//! One module per role or admin tool; each exposes `run`.

pub mod activity;
pub mod admission;
pub mod api;
pub mod baseline;
pub mod bench;
pub mod bench_backlog;
pub mod bench_broker;
pub mod compensate;
pub mod consume;
pub mod dlq;
pub mod migrate;
pub mod projection;
pub mod reconcile;
pub mod scan;
pub mod timeout_cancel;
pub mod topics;
