# seckill — the front door. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

.PHONY: image image-test test-upgrade help services-up services-down build demo demo-cluster bench bench-crowd bench-sale bench-orders bench-relay bench-ceilings bench-fair bench-sync bench-buckets bench-payments bench-payments-small limits test test-faults chaos soak soak-small send-timeouts test-unit fmt clippy lint ci

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  %-14s %s\n", $$1, $$2}'

services-up: ## Start PostgreSQL, Redis, RocketMQ name server + broker (installs what is missing)
	scripts/services-up.sh

services-down: ## Stop the RocketMQ processes the project started
	scripts/services-down.sh

build: ## Build the release binaries (seckill, and seckill-bench for the benchmarks)
	cargo build --release

image: ## Build the seckill image (podman) from the Dockerfile, from local Debian bases where public images cannot be pulled
	scripts/image.sh

image-test: ## The image against the host's services: api + consume containers turn a reservation into an order; last line IMAGE_TEST OK/FAILED (slow: not in make test)
	scripts/image-test.sh

test-upgrade: ## A sale on the previous release (RELEASES' newest below HEAD, built once from its commit and cached) upgraded to this checkout mid-sale (migrate, consumers, then producers, v2, quarantine replay); last line UPGRADE OK/FAILED (slow: not in make test)
	scripts/upgrade-test.sh

demo: ## Services, migrate, a flash sale with a burst of buyers, invariants; last line DEMO OK/FAILED
	scripts/demo.sh

demo-cluster: ## The demo on Redis Cluster, two brokers and every role many times, with a broker kill and a Redis failover mid-sale; last line DEMO OK/FAILED
	scripts/demo-cluster.sh

bench: ## Limits of this machine + the pipeline's figures; last line RATIOS ... (BENCHMARKS.md)
	scripts/bench.sh

bench-buckets: ## One hot SKU over stock buckets: Redis calls/s and per-primary share (K=1,3,6), orders/s and lock waits per transaction over K=1,2,4,8 rows, one transaction per bucket and mixed; last line BUCKETS ...
	scripts/bench-buckets.sh

bench-sale: ## Only the bench's sale: whole pipeline, front door alone, direct PostgreSQL; last line SALE_RATIOS ...
	BENCH_ONLY=sale scripts/bench.sh

bench-orders: ## Only the order work: pgbench's batch and the consumer on a backlog, each with its CPU per order; last line ORDER_RATIOS ...
	BENCH_ONLY=orders scripts/bench.sh

bench-relay: ## Only the outbox relay on the events the order backlogs leave, beside the broker's raw rate; last line RELAY_RATIOS ...
	BENCH_ONLY=relay scripts/bench.sh

bench-crowd: ## Only the crowd as it arrives: open-loop steps at 0.5x/1x/3x/10x the direct design's capacity, both designs, PostgreSQL on its own core, every stage; last line CROWD_RATIOS ...
	BENCH_ONLY=crowd scripts/bench.sh

bench-sync: ## The price of a synchronous standby: pgbench's batch of the order transaction on a pg_auto_failover pair, standby in the commit quorum and out of it, alternating; last line SYNC_RATIOS ...
	scripts/bench-sync.sh

bench-fair: ## Only the mixed crowd: the share of units that reach people first come, drawn, and drawn among sale-pass holders; last line FAIR_RATIOS ...
	BENCH_ONLY=fair scripts/bench.sh

bench-ceilings: ## Only the front door's ceilings with wrk (healthz, sold out per token algorithm, cache on/off, accepted path, direct server); last line CEILING_RATIOS ...
	BENCH_ONLY=ceilings scripts/bench.sh

bench-payments: ## The payment path's ORDER_PAID through the outbox and as transaction messages, side by side; last line PAYMENTS_RATIOS ... (BENCHMARKS.md)
	SECKILL_MQ_BUILD=release scripts/services-up.sh
	cargo build --release --quiet -p seckill-bench
	SECKILL_ENV=bench target/release/seckill-bench payments --orders 2000 --concurrency 16 --rounds 3

bench-payments-small: ## make bench-payments in seconds on the debug build: it runs and both modes deliver every event (figures meaningless)
	cargo build --all-targets --features failpoints --quiet
	SECKILL_ENV=bench target/debug/seckill-bench payments --orders 100 --concurrency 8 --rounds 1

limits: services-up ## Only the naive limits (pgbench, redis-benchmark, direct PostgreSQL); last line LIMITS ...
	bench/limits/limits.sh

test: services-up ## The whole test suite against the real services, the operator files, schemathesis, a small soak, then the faults on the shared services
	SECKILL_ENV=test cargo test --all-targets --features failpoints -- --test-threads=4
	scripts/check-operator-files.sh
	scripts/releases.sh check
	scripts/check-migrations.sh --self-test
	scripts/check-cycles.py --self-test
	scripts/check-cycles.py
	scripts/check-doc-links.py --self-test
	scripts/check-doc-links.py
	scripts/check-build-graph.py --self-test
	scripts/check-build-graph.py
	scripts/check-migrations.sh
	scripts/schemathesis.sh
	$(MAKE) soak-small
	$(MAKE) bench-payments-small
	$(MAKE) test-faults

soak: ## A long sale at a steady rate with payments and timeouts, sampled every 15 s; last line SOAK OK/FAILED
	scripts/soak.sh

# The debug binaries for soak-small and bench-payments-small come from `cargo build --all-targets`
# with the tests' feature set: it resolves the dependencies as make test's `cargo test` does, so
# nothing is compiled a second time (a plain `cargo build` drops the dev-dependencies' features,
# tokio's test-util among them, and recompiled most of the graph: 271 s).
soak-small: ## make soak in one minute on the debug build (too short to judge memory growth)
	cargo build --all-targets --features failpoints --quiet
	SECKILL_BIN=target/debug/seckill SOAK_DURATION_SECS=45 SOAK_RATE=50 SOAK_PAY_WINDOW_SECS=20 \
	  SOAK_SAMPLE_SECS=5 SOAK_MAX_RSS_SLOPE_MIB_PER_MIN=1000 scripts/soak.sh

send-timeouts: ## UNKNOWN rate of a send against its timeout and client retries, and the broker profiles' cost (restarts the broker)
	scripts/send-timeouts.sh

test-faults: services-up ## Faults that disturb the shared services (a broker killed, one of two brokers killed, each of two name servers killed, a Redis primary failed over, PostgreSQL restarted, a PostgreSQL pair's primary killed and its standby promoted) and a Redis of its own that forgets its last second, one at a time; last step of make test
	SECKILL_ENV=test cargo test --features failpoints --test it -- --ignored --test-threads=1 sale_faults:: redis_loss_faults:: rebuild_under_sale:: broker_disk:: pg_failover::

chaos: ## A whole sale (intake, backlog, payments, cancellations) under faults by phase: every role, the broker, PostgreSQL and its own AOF Redis; CHAOS_RUN line
	scripts/chaos.sh

test-unit: ## Unit tests only (no services)
	cargo test --lib --bins

.PHONY: test-api-fuzz
test-api-fuzz: ## schemathesis against a live api (docs/openapi.yaml)
	scripts/schemathesis.sh

fmt: ## Format the code
	cargo fmt --all

clippy: ## Lints, warnings are errors
	cargo clippy --all-targets -- -D warnings

lint: ## fmt check + clippy (with and without the failpoints feature)
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features failpoints -- -D warnings

ci: ## What CI runs, exactly (.ci/run): make test, with make lint beside it at the lowest CPU priority
	bash .ci/run
