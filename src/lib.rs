//! seckill: a flash-sale order pipeline. Redis picks the winners, RocketMQ absorbs the burst,
//! PostgreSQL creates every order exactly once. README.md is the front page; docs/RUNNING.md says
//! how to run it, docs/ARCHITECTURE.md how it works and where each failure is handled.
//!
//! A short tour, from the top of the house down (nothing imports upward, and no two modules,
//! nor two files of one module, import each other: `scripts/check-cycles.py`, in `make test`):
//!
//! - [`cli`] — the `seckill` subcommands: `cli::main` parses them, loads [`config`], starts
//!   [`telemetry`] and calls the role's `run`.
//! - [`roles`] — what the binary runs:
//!   - `roles::api` — the buyers' HTTP API and the hot path (reserve → send → 202), the
//!     buyer's reads and payment, fail-closed admission;
//!   - `roles::consume` — every consumer group that turns messages into effects: order
//!     creation, compensation, projection, DLQ intake;
//!   - `roles::scan` — the re-send scanner, the outbox relay, retention;
//!   - `roles::timeout_cancel` — the conditional cancel of unpaid, expired orders;
//!   - `roles::ops` — operator tools: `migrate`, `topics`, `activity`, `dlq`, `reconcile`.
//! - [`services`] — what several roles share, below them (no role imports another):
//!   - `services::resync` — fencing an activity whose Redis state is behind, and its rebuild
//!     from PostgreSQL;
//!   - `services::half_messages` — events as RocketMQ transaction messages: the producer the
//!     payment and the timeout cancel share, and its check-back answered from PostgreSQL;
//!   - `services::batch_tx` — bounded, adaptive transactions split on failure;
//!   - `services::poison` — quarantine of a body a consumer group cannot read.
//! - [`domain`] — the vocabulary, free of I/O: ids, the events and their ids, request
//!   validation, the decisions, the words that carry state (`domain::status`).
//! - [`redis`] — the reservation store: one Lua script per state change (`redis/lua/`).
//! - [`mq`] — the RocketMQ adapter: the `Publisher` / `TransactionPublisher` / `BatchHandler`
//!   traits the roles see, batched sends, consumer lag, and the client behind them
//!   (`mq::rocketmq`).
//! - [`pg`] — PostgreSQL: pools and migrations, the order transaction, the order state
//!   changes, the rows several of them write (`pg::rows`: ledger, compensation, outbox), the
//!   outbox and the rows of transaction messages, dead letters and their replay, retention.
//! - [`plan`] — `seckill plan`: a fleet sized for a target from the costs `make bench`
//!   measured (docs/SCALING.md#sizing-a-fleet).
//! - [`limiter`] — the adaptive limit on order transactions, under the worker budget.
//! - [`invariants`] — the six invariants, checked by tests, `seckill-bench` and the demo.
//! - [`http`] — every HTTP listener (HTTP/1.1 only), with limits against slow and hostile clients.
//! - [`shutdown`], [`telemetry`] — graceful shutdown; logs, metrics, `/metrics`, readiness.
//!
//! The load generators and the direct-PostgreSQL baseline are not part of the product: they
//! live in their own binary, `seckill-bench` (`bench/`).
//!
//! Two words kept apart: `_tx` names a PostgreSQL transaction (`pg::order_tx`, `pg::cancel_tx`,
//! `services::batch_tx`); a RocketMQ transaction message is a *half message*
//! (`services::half_messages`, `mq::rocketmq::half_message`, `pg::half_message_events`). `domain::order_create` is the
//! inbound ORDER_CREATE_REQUESTED message; `domain::events` the events PostgreSQL originates.

// The RocketMQ client's futures are deeply nested; proving them Send needs a deeper limit.
#![recursion_limit = "256"]

pub mod archive;
pub mod auth;
pub mod cli;
pub mod config;
pub mod domain;
pub mod gather;
pub mod http;
pub mod invariants;
pub mod limiter;
pub mod mq;
pub mod pg;
pub mod plan;
pub mod redis;
pub mod roles;
pub mod services;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
