//! The tests that set a failpoint inside the test process: a failpoint is global to the
//! process and these are not keyed by the test's own message (an API's admission loop panics,
//! every order transaction runs a callback, a bucket move stops midway), so they run apart from
//! the `it` binary, and each holds [`common::process_failpoints`] while its failpoint is set.

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

#[path = "../it/common/mod.rs"]
mod common;

mod stock_buckets;
mod stock_fallback;
#[cfg(feature = "failpoints")]
mod watchdog;
