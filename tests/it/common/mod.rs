//! Shared set-up for the integration tests: every test gets its own PostgreSQL schema, Redis
//! key prefix and environment name (so its own topics and consumer groups) on the real
//! services that `make test` starts. One file per concern; everything is re-exported here, so
//! a test names `common::spawn`, `common::TestEnv`, ... whatever file holds it.
#![allow(dead_code)]

mod api;
mod env;
mod net;
mod orders;
mod procs;
mod provider;
mod role_metrics;
mod roles;
pub mod sale;
mod wait;

// Both test binaries (tests/it, tests/isolated) include this module and each uses a part.
#[allow(unused_imports)]
pub use {
    api::*, env::*, net::*, orders::*, procs::*, provider::*, role_metrics::*, roles::*, wait::*,
};
