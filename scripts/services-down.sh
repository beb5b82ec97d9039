#!/usr/bin/env bash
# Stops what services-up.sh started for the project (RocketMQ, the Redis Cluster's nodes).
# PostgreSQL and Redis belong to the machine and are left running.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/rocketmq-down.sh"
"$here/redis-cluster-down.sh"
