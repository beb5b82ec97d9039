//! No silently dead loop: when a background task of a role panics, the role stops taking work
//! and exits non-zero, naming the task (docs/architecture/roles.md#graceful-shutdown). Failpoints
//! make the loops panic; the in-process one lives in the `isolated` test binary and holds
//! `common::process_failpoints`, so it touches no other test.

use crate::common;

use std::time::Duration;

use crate::common::{free_port, start_api, TestEnv};

#[tokio::test]
async fn scan_whose_relay_loop_panics_exits_non_zero_naming_it() {
    let env = TestEnv::with_topics().await;
    let port = free_port();
    let mut cmd = common::command(&env, &["scan"]);
    cmd.env("FAILPOINTS", "scan-relay-loop=panic")
        .env("SECKILL__SCAN__METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("binary starts");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("scan exits by itself instead of running on without its relay")
    .unwrap()
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{:?}\n{text}", out.status);
    assert!(
        text.contains("background task relay panicked"),
        "the exit names the dead task:\n{text}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn api_whose_admission_check_panics_turns_unready_and_stops_with_an_error() {
    let env = TestEnv::without_topics().await;
    let mut settings = env.settings.clone();
    settings.api.admission_check_ms = 50;
    let api = start_api(settings).await;
    let (ready, stop, server) = (api.ready, api.stop, api.server);
    assert!(ready.get());

    let _only_failpoints = common::process_failpoints().await;
    fail::cfg("api-admission-loop", "panic").unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the API stops by itself")
        .unwrap();
    fail::remove("api-admission-loop");
    let err = result.expect_err("an error, so the process exits non-zero");
    assert!(
        err.to_string()
            .contains("background task admission panicked"),
        "{err}"
    );
    assert!(!ready.get(), "/readyz answers 503 from the moment it died");
    assert!(
        !stop.is_cancelled(),
        "it stopped on its own, not by the caller"
    );
    env.cleanup().await;
}
