//! seckill: a flash-sale order pipeline. Redis picks the winners, RocketMQ absorbs the burst,
//! PostgreSQL creates every order exactly once. See README.md and DESIGN.md.

// The RocketMQ client's futures are deeply nested; proving them Send needs a deeper limit.
#![recursion_limit = "256"]

pub mod cli;
pub mod config;
pub mod domain;
pub mod invariants;
pub mod limiter;
pub mod mq;
pub mod pg;
pub mod redis;
pub mod roles;
pub mod telemetry;
