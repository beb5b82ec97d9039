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
        ("SECKILL__PG__SAFE_CONCURRENCY", "0", "pg.safe_concurrency"),
        ("SECKILL__MQ__SEND_TIMEOUT_MS", "0", "mq.send_timeout_ms"),
        (
            "SECKILL__MQ__NAME_SERVER",
            "not an address",
            "mq.name_server",
        ),
        (
            "SECKILL__CONSUMER__BATCH_SIZE",
            "100",
            "consumer.batch_size",
        ),
        ("SECKILL__API__LISTEN", "nowhere", "api.listen"),
        (
            "SECKILL__PG__SAFE_CONCURRENCY",
            "many",
            "pg.safe_concurrency",
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
