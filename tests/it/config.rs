//! A bad configuration fails at start-up and names the key.

use std::process::Command;

fn run_with(var: &str, value: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_seckill"))
        .arg("migrate")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env(var, value)
        .output()
        .expect("binary runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn a_bad_value_fails_start_up_naming_the_key() {
    let cases = [
        ("SECKILL__PG__ORDER_SHARE", "1.5", "pg.order_share"),
        // 0.7 (default order share) + 0.5 is more than the database's concurrency.
        ("SECKILL__PG__CANCEL_SHARE", "0.5", "pg.cancel_share"),
        ("SECKILL__PG__SAFE_CONCURRENCY", "0", "pg.safe_concurrency"),
        ("SECKILL__MQ__SEND_TIMEOUT_MS", "0", "mq.send_timeout_ms"),
        (
            "SECKILL__MQ__NAME_SERVER",
            "not an address",
            "mq.name_server",
        ),
        ("SECKILL__CONSUMER__BATCH_SIZE", "65", "consumer.batch_size"),
        // Held longer, an order could miss its 3 s reservation->order SLO.
        (
            "SECKILL__CONSUMER__PACE_AGE_MS",
            "2500",
            "consumer.pace_age_ms",
        ),
        ("SECKILL__API__LISTEN", "nowhere", "api.listen"),
        // A guessable admin token: under 32 bytes.
        (
            "SECKILL__API__ADMIN_TOKEN",
            "admin-token-of-31-bytes-0123456",
            "api.admin_token",
        ),
        // A head cap under the HTTP/1 parser's floor.
        ("SECKILL__API__MAX_HEAD_BYTES", "4096", "api.max_head_bytes"),
        ("SECKILL__REDIS__MODE", "sharded", "redis.mode"),
        // Keys over plain http from another host could be anyone's.
        (
            "SECKILL__AUTH__JWKS_URL",
            "http://login.shop.example/jwks.json",
            "auth.jwks_url",
        ),
        (
            "SECKILL__AUTH__JWKS_MIN_REFRESH_SECS",
            "0",
            "auth.jwks_min_refresh_secs",
        ),
        (
            "SECKILL__AUTH__JWKS_TIMEOUT_MS",
            "60000",
            "auth.jwks_timeout_ms",
        ),
        // Several seed nodes are for Redis Cluster only.
        (
            "SECKILL__REDIS__URL",
            "redis://127.0.0.1:7001,redis://127.0.0.1:7002",
            "redis.url",
        ),
        (
            "SECKILL__PG__SAFE_CONCURRENCY",
            "many",
            "pg.safe_concurrency",
        ),
        ("SECKILL__PG__SCAN_INSTANCES", "0", "pg.scan_instances"),
        (
            "SECKILL__PG__CONSUME_INSTANCES",
            "0",
            "pg.consume_instances",
        ),
    ];
    for (var, value, key) in cases {
        let (code, stderr) = run_with(var, value);
        assert_eq!(code, Some(2), "{var}={value}: {stderr}");
        assert!(
            stderr.contains(key),
            "{var}={value} should name `{key}`: {stderr}"
        );
    }
}

/// Runs `seckill <args>` with `vars` and returns its exit code and everything it printed
/// (stdout and stderr: logs go to one or the other).
fn run_printing(args: &[&str], vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__TELEMETRY__LOG_LEVEL", "debug");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("binary runs");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn passwords_in_connection_urls_are_never_printed() {
    // PostgreSQL nobody listens for: the error names the key and the host, not the password.
    let (code, out) = run_printing(
        &["migrate"],
        &[(
            "SECKILL__PG__URL",
            "host=127.0.0.1 port=1 user=seckill password=SENTINEL-PG dbname=x connect_timeout=2",
        )],
    );
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("pg.url") && out.contains("127.0.0.1:1"),
        "{out}"
    );
    assert!(!out.contains("SENTINEL"), "the password leaked:\n{out}");

    // Redis nobody listens for, through a role that starts it first after PostgreSQL.
    let (code, out) = run_printing(
        &["api"],
        &[
            ("SECKILL__REDIS__URL", "redis://:SENTINEL-REDIS@127.0.0.1:1"),
            ("SECKILL__API__LISTEN", "127.0.0.1:0"),
        ],
    );
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("redis.url"), "{out}");
    assert!(!out.contains("SENTINEL"), "the password leaked:\n{out}");

    // A connection string that does not parse: named, not quoted.
    let (code, out) = run_printing(
        &["migrate"],
        &[(
            "SECKILL__PG__URL",
            "host=127.0.0.1 password=SENTINEL-BAD port=notaport",
        )],
    );
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("pg.url"), "{out}");
    assert!(!out.contains("SENTINEL"), "the password leaked:\n{out}");
}

/// Every default a document quotes beside its key (`` `mq.order_create_queues` (64) `` or
/// `` `mq.order_create_queues` = 64 ``) is the value in `config/default.toml`: the docs cannot
/// keep a number the config no longer has.
#[test]
fn the_docs_quote_the_configs_defaults() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let defaults = config::Config::builder()
        .add_source(config::File::from(root.join("config/default.toml")))
        .build()
        .expect("config/default.toml parses");
    let mut docs = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            // The history of measurements quotes the values of its day.
            } else if path.extension().is_some_and(|e| e == "md")
                && !path.ends_with("benchmarks-history.md")
            {
                docs.push(path);
            }
        }
    }
    let (mut checked, mut wrong) = (0, Vec::new());
    for path in &docs {
        let text = std::fs::read_to_string(path).unwrap();
        for (key, quoted) in quoted_defaults(&text) {
            let Ok(value) = defaults.get::<String>(&key) else {
                continue;
            };
            checked += 1;
            if value != quoted {
                wrong.push(format!(
                    "{}: `{key}` quoted as {quoted}, config/default.toml has {value}",
                    path.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        checked >= 3,
        "only {checked} quoted defaults found: the pattern broke"
    );
}

/// (key, number) for each `` `a.b` (N) `` and `` `a.b` = N `` in `text` (N without its commas).
fn quoted_defaults(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        let key = &after[..close];
        let tail = &after[close + 1..];
        rest = tail;
        let is_key = key.contains('.')
            && key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.');
        if !is_key {
            continue;
        }
        let (raw, paren) = if let Some(t) = tail.strip_prefix(" (") {
            (t, true)
        } else if let Some(t) = tail.strip_prefix(" = ") {
            (t, false)
        } else {
            continue;
        };
        let digits: String = raw
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '.')
            .collect();
        let digits = digits.trim_end_matches(['.', ',']);
        // "(8)" must close right after the number to be a quoted value, not prose.
        if digits.is_empty() || (paren && !raw[digits.len()..].starts_with(')')) {
            continue;
        }
        out.push((key.to_string(), digits.replace(',', "")));
    }
    out
}

#[test]
fn a_role_whose_fleet_would_pass_max_connections_refuses_to_start_and_budget_says_why() {
    // The shipped fleet fits: `seckill budget` prints every role and exits 0.
    let budget = budget_json(&[]);
    let roles: Vec<&str> = budget["roles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["api", "consume", "timeout-cancel", "scan"]);
    let total = budget["total"].as_u64().unwrap();
    let counted: u64 = budget["roles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["total"].as_u64().unwrap())
        .sum::<u64>()
        + budget["operators"].as_u64().unwrap();
    assert_eq!(total, counted);

    // Twenty API instances of 4 connections do not fit in 90: every role refuses to start
    // (exit 2, naming the key), and `seckill budget` prints the table and exits 1.
    let crowded = [("SECKILL__PG__API_INSTANCES", "20")];
    for role in ["api", "scan"] {
        let (code, out) = run_printing(&[role], &crowded);
        assert_eq!(code, Some(2), "{role}: {out}");
        assert!(out.contains("`pg.max_connections`"), "{role}: {out}");
        assert!(out.contains("api 20 x 4"), "{role}: {out}");
    }
    let (code, out) = run_printing(&["budget"], &crowded);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("OVER"), "{out}");
    // A one-shot command is not a role: it still runs (here, a budget that fits again).
    let (code, out) = run_printing(
        &["budget"],
        &[
            ("SECKILL__PG__API_INSTANCES", "20"),
            ("SECKILL__PG__MAX_CONNECTIONS", "200"),
        ],
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("fits"), "{out}");
}

/// `seckill budget --json` with `vars`: its JSON (it must exit 0).
fn budget_json(vars: &[(&str, &str)]) -> serde_json::Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(["budget", "--json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("binary runs");
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_deprecated_instances_key_still_counts_the_roles_it_counted_and_says_what_replaces_it() {
    let instances = |b: &serde_json::Value, role: &str| {
        b["roles"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["role"] == role)
            .unwrap()["instances"]
            .as_u64()
            .unwrap()
    };
    // Alone, it counts both (as before); a new key set beside it wins for its role.
    let b = budget_json(&[("SECKILL__PG__INSTANCES", "4")]);
    assert_eq!(
        (instances(&b, "consume"), instances(&b, "timeout-cancel")),
        (4, 4)
    );
    let b = budget_json(&[
        ("SECKILL__PG__INSTANCES", "4"),
        ("SECKILL__PG__TIMEOUT_CANCEL_INSTANCES", "2"),
    ]);
    assert_eq!(
        (instances(&b, "consume"), instances(&b, "timeout-cancel")),
        (4, 2)
    );
    // Four consumers split the order budget: 8 x 0.7 / 4 = 1, and one more connection.
    let consume = b["roles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["role"] == "consume")
        .unwrap();
    assert_eq!(consume["pools"][0]["connections"], 2);
    let (code, out) = run_printing(&["budget"], &[("SECKILL__PG__INSTANCES", "4")]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("pg.instances = 4 is deprecated") && out.contains("pg.consume_instances"),
        "{out}"
    );
}
