//! Slow and stalling clients cannot hold the API (docs/architecture/hot-path.md#slow-clients): a
//! client that stalls mid-body holds a connection until the request timeout, never a reservation
//! permit; a client that never finishes its request head, or idles on a kept-alive connection, is
//! closed after the header read timeout. Its own test process: it opens thousands of sockets.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{closed_within, start_api, TestEnv};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const STALLED: usize = 2048;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_bodies_hold_no_permit_and_are_closed_by_the_request_timeout() {
    let env = TestEnv::with_topics().await;
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
    let env = TestEnv::without_topics().await;
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

/// A real buyer's request, answered while the attackers hold their connections.
async fn a_buyer_is_served(addr: std::net::SocketAddr, activity: i64, user: i64) {
    let r = reqwest::Client::new()
        .post(format!(
            "http://{addr}/v1/activities/{activity}/skus/1/reservations"
        ))
        .header("authorization", common::bearer(user))
        .json(&json!({"request_id": format!("real-{user}"), "quantity": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status.as_u16(), 202, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http2_prefaces_and_silent_connections_are_closed_like_a_slow_head() {
    const EACH: usize = 200;
    let env = TestEnv::with_topics().await;
    env.activity(971, 1, 10).await;
    let mut settings = env.settings.clone();
    settings.api.header_read_timeout_ms = 1_000;
    let api = start_api(settings).await;
    let addr = api.addr;
    let started = Instant::now();
    // The whole HTTP/2 prior-knowledge preface, then nothing; its first line only; a
    // connection that says nothing at all (the HTTP/1 preface check used to wait for 24
    // bytes, without a timer).
    let attacks: [&[u8]; 3] = [
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"PRI * HTTP/2.0\r\n",
        b"",
    ];
    let mut held = Vec::new();
    for attack in attacks {
        for _ in 0..EACH {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(attack).await.unwrap();
            held.push((attack, s));
        }
    }
    a_buyer_is_served(addr, 971, 1).await;
    let closed = futures::future::join_all(held.into_iter().map(|(attack, s)| async move {
        let answer = closed_within(s, 6).await;
        (attack, answer, started.elapsed())
    }))
    .await;
    for attack in attacks {
        let of: Vec<_> = closed.iter().filter(|(a, _, _)| *a == attack).collect();
        let open = of.iter().filter(|(_, answer, _)| answer.is_none()).count();
        let last = of.iter().map(|(_, _, at)| *at).max().unwrap();
        eprintln!(
            "{:?}: {} connections, {open} still open after 6 s, the last closed {last:?} after \
             they were opened",
            String::from_utf8_lossy(attack),
            of.len()
        );
        assert_eq!(open, 0, "{:?}", String::from_utf8_lossy(attack));
    }
    // HTTP/2 is not spoken: a client that tries it is refused, never upgraded.
    let mut h2 = TcpStream::connect(addr).await.unwrap();
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let answer = closed_within(h2, 6).await.expect("closed");
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 "),
        "no HTTP/2 frame comes back: {answer:?}"
    );

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_never_reads_its_answers_is_closed_and_frees_its_slot() {
    let env = TestEnv::with_topics().await;
    env.activity(972, 1, 10).await;
    let mut settings = env.settings.clone();
    settings.api.write_timeout_ms = 1_000;
    // One slot: the stalled reader must give it back before the buyer can be served.
    settings.api.max_connections = 1;
    let api = start_api(settings).await;
    let addr = api.addr;
    // A small receive window, pipelined requests, and never a read: the server's answers fill
    // both sockets' buffers and its writes stall.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    let requests = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n".repeat(1000);
    let started = Instant::now();
    let mut sent = 0usize;
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        // Bounded: 64 MB of requests at most.
        for _ in 0..2000 {
            if let Err(e) = s.write_all(&requests).await {
                return Some(e);
            }
            sent += requests.len();
        }
        None
    })
    .await;
    let err = outcome
        .expect("the server closed the connection within 30 s")
        .expect("the server closed the connection before 64 MB of requests");
    let took = started.elapsed();
    eprintln!(
        "never-reading client: closed by the server after {took:?} and {sent} bytes of \
         requests ({err})"
    );
    // Its slot is free again: the one-connection listener serves a buyer.
    a_buyer_is_served(addr, 972, 2).await;
    let metrics = seckill::telemetry::metrics_handle().render();
    let stalled = metrics
        .lines()
        .find(|l| {
            l.starts_with("http_connection_errors_total")
                && l.contains(r#"listener="buyers""#)
                && l.contains(r#"reason="write_stalled""#)
        })
        .unwrap_or_else(|| panic!("no write_stalled close counted:\n{metrics}"));
    eprintln!("{stalled}");

    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), api.server).await;
    env.cleanup().await;
}
