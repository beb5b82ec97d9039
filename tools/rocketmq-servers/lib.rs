//! Empty on purpose: this package only puts the RocketMQ name server and broker crates into the
//! workspace's lock and dependency graph, so `scripts/install-rocketmq.sh` builds their own
//! binaries (`rocketmq-namesrv-rust`, `rocketmq-broker-rust`) in the project's target directory,
//! compiling the crates they share with the project once for both. docs/RUNNING.md, "The first
//! run", has the figures.
