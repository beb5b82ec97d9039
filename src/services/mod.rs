//! What several roles share, below them: no role imports another role
//! (docs/ARCHITECTURE.md#the-code).
//!
//! - `resync`: fencing an activity whose Redis state is behind, and rebuilding it from
//!   PostgreSQL (raised by api, consume, scan and `seckill activity resync`).
//! - `half_messages`: events as RocketMQ transaction messages, their producer and check-back
//!   (api's payments, timeout-cancel).
//! - `batch_tx`: the bounded, adaptive, split-on-failure transactions of consume and
//!   timeout-cancel.
//! - `poison`: how every consumer group quarantines a body it cannot read.
//! - `failure_groups`: dead letters and quarantined messages grouped by what failed (the dlq
//!   commands, and consume's per-group gauge).
//! - `tickets`: a new group of failures posted once to the ticket hook, signed (consume).

pub mod batch_tx;
pub mod failure_groups;
pub mod half_messages;
pub mod poison;
pub mod resync;
pub mod tickets;
