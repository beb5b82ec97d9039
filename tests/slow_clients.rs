//! Slow and stalling clients cannot hold the API (docs/ARCHITECTURE.md#slow-clients): a client
//! that stalls mid-body holds a connection until the request timeout, never a reservation
//! permit; a client that never finishes its request head, or idles on a kept-alive connection,
//! is closed after the header read timeout. Its own test process: it opens thousands of
//! sockets.
// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

use std::time::{Duration, Instant};

use common::{start_api, TestEnv};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const STALLED: usize = 2048;

/// Reads until the server closes the connection; `None` if it is still open after `secs`.
async fn closed_within(mut s: TcpStream, secs: u64) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_bodies_hold_no_permit_and_are_closed_by_the_request_timeout() {
    let env = TestEnv::new(true).await;
    env.activity(970, 1, 10).await;
    let mut settings = env.settings.clone();
    // As many stalled clients as there are permits: before, every permit was held.
    settings.api.max_inflight = STALLED;
    settings.api.request_timeout_ms = 2_000;
    settings.api.header_read_timeout_ms = 2_000;
    let api = start_api(settings).await;
    let addr = api.addr;

    // Headers (with a valid buyer token: the strongest such client) and one byte of a 60-byte
    // body, then nothing.
    let head = format!(
        "POST /v1/activities/970/skus/1/reservations HTTP/1.1\r\nhost: x\r\n\
         authorization: {}\r\ncontent-type: application/json\r\ncontent-length: 60\r\n\r\n{{",
        common::bearer(1)
    );
    let mut stalled = Vec::with_capacity(STALLED);
    for _ in 0..STALLED {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        stalled.push(s);
    }
    // Let the server take them all in.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(format!(
            "http://{addr}/v1/activities/970/skus/1/reservations"
        ))
        .header("authorization", common::bearer(7))
        .json(&json!({"user_id": 7, "request_id": "real-buyer", "quantity": 1}))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    let status = r.status();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status.as_u16(), 202, "{body}");
    assert!(took < Duration::from_secs(2), "answered in {took:?}");

    // Each stalled client gets 408 and its connection closed, within the request timeout.
    let closed = futures::future::join_all(stalled.into_iter().map(|s| closed_within(s, 6))).await;
    let still_open = closed.iter().filter(|c| c.is_none()).count();
    assert_eq!(still_open, 0, "connections the server never closed");
    let timed_out = closed
        .iter()
        .flatten()
        .filter(|b| String::from_utf8_lossy(b).starts_with("HTTP/1.1 408"))
        .count();
    assert_eq!(timed_out, STALLED, "every stalled request answered 408");

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_unfinished_request_head_and_an_idle_connection_are_closed() {
    let env = TestEnv::new(false).await;
    let mut settings = env.settings.clone();
    settings.api.header_read_timeout_ms = 1_000;
    let api = start_api(settings).await;
    let addr = api.addr;

    // Half a request line, never finished.
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"GET /heal").await.unwrap();
    // A complete request on a kept-alive connection, then silence.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (half, idle) = tokio::join!(closed_within(half, 5), closed_within(idle, 5));
    assert!(half.is_some(), "a head that never ends is cut off");
    let idle = idle.expect("an idle kept-alive connection is closed");
    assert!(
        String::from_utf8_lossy(&idle).starts_with("HTTP/1.1 200"),
        "its request was answered first"
    );

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}
