//! The API's listeners as an attacker from outside meets them
//! (docs/architecture/hot-path.md#slow-clients, docs/architecture/security.md#admin-surface):
//! request heads are capped and cost at most their cap, the operators' figures are not on the
//! buyers' port, and the admin door cannot be guessed at speed. Each attack is sent as the attacker
//! would (raw sockets where it matters), and a real caller is served meanwhile.

use crate::common;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use futures::StreamExt as _;

use crate::common::{closed_within, free_port, spawn, start_api, wait_ready, TestEnv};
use reqwest::StatusCode;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A request head that never ends, exactly `len` bytes long.
fn unfinished_head(len: usize) -> Vec<u8> {
    let mut head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: ".to_vec();
    head.resize(len, b'a');
    head
}

#[tokio::test]
async fn a_head_past_the_cap_is_answered_431_and_closed_and_one_under_it_is_served() {
    let env = TestEnv::without_topics().await;
    let mut settings = env.settings.clone();
    // Long enough that only the size can close these connections.
    settings.api.header_read_timeout_ms = 20_000;
    let cap = settings.api.max_head_bytes;
    let api = start_api(settings).await;

    // Exactly the cap, unfinished: the parser's buffer is full, 431, closed.
    let mut s = TcpStream::connect(api.addr).await.unwrap();
    s.write_all(&unfinished_head(cap)).await.unwrap();
    let answer = closed_within(s, 5).await.expect("closed at the cap");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

    // The attacker's 390 KB of headers: cut off at the cap, the connection closed long before
    // the header timeout.
    let started = Instant::now();
    let mut s = TcpStream::connect(api.addr).await.unwrap();
    let big = unfinished_head(390 * 1024);
    let _ = tokio::time::timeout(Duration::from_secs(5), s.write_all(&big)).await;
    assert!(
        closed_within(s, 5).await.is_some(),
        "a 390 KB head is not held"
    );
    eprintln!("390 KB head: closed {:?} after it began", started.elapsed());

    // A real client's head, a little under the cap (a long token, cookies): served.
    let mut s = TcpStream::connect(api.addr).await.unwrap();
    let mut head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncookie: ".to_vec();
    head.resize(cap - 512, b'c');
    head.extend_from_slice(b"\r\n\r\n");
    s.write_all(&head).await.unwrap();
    let answer = closed_within(s, 5).await.expect("answered and closed");
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");

    api.stop.cancel();
    env.cleanup().await;
}

/// The resident set of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Connections that each send `bytes` of a head that never ends, then hold still.
async fn half_sent_heads(port: u16, n: usize, bytes: usize) -> Vec<TcpStream> {
    let head = unfinished_head(bytes);
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        // A head past the cap is refused mid-write: the write may fail, the socket is kept.
        let _ = tokio::time::timeout(Duration::from_secs(2), s.write_all(&head)).await;
        held.push(s);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_sent_heads_hold_at_most_their_cap_of_memory() {
    const HELD: usize = 1000;
    const REFUSED: usize = 300;
    let env = TestEnv::with_topics().await;
    env.activity(973, 1, 10).await;
    let (port, ops) = (free_port(), free_port());
    let api = spawn(
        &env,
        &["api"],
        "",
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{port}")),
            ("SECKILL__API__METRICS_LISTEN", format!("127.0.0.1:{ops}")),
            ("SECKILL__API__HEADER_READ_TIMEOUT_MS", "60000".into()),
        ],
    );
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let pid = api.0.id();
    let cap = env.settings.api.max_head_bytes;
    // Warm the allocator with a round of the same connections, closed again.
    drop(half_sent_heads(port, HELD / 4, cap - 1).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss(pid);
    // Heads one byte under the cap, held; and heads of 256 KB, which used to be held whole.
    let held = half_sent_heads(port, HELD, cap - 1).await;
    let refused = half_sent_heads(port, REFUSED, 256 * 1024).await;
    // Let the server read what it will.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss(pid);
    let per = after.saturating_sub(before) / HELD as u64;
    eprintln!(
        "RSS {} KiB -> {} KiB with {HELD} heads of {} bytes held and {REFUSED} of 256 KiB \
         refused: {} bytes per held connection (cap {cap})",
        before / 1024,
        after / 1024,
        cap - 1,
        per
    );
    assert!(
        per <= (cap + 24 * 1024) as u64,
        "{per} bytes per half-sent head, above its cap plus the connection's own state"
    );
    // The 256 KiB heads were closed; the held ones are still open.
    let closed = futures::future::join_all(refused.into_iter().map(|s| closed_within(s, 5))).await;
    assert!(
        closed.iter().all(Option::is_some),
        "every oversized head closed"
    );
    // And a buyer is served beside the 1,000 held connections.
    let (s, b) = common::reserve_as(&format!("http://127.0.0.1:{port}"), 973, 1, 5, "r5").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    drop(held);
    drop(api);
    env.cleanup().await;
}

#[tokio::test]
async fn the_buyers_port_serves_no_metrics_and_the_ops_port_does() {
    let env = TestEnv::without_topics().await;
    let api = start_api(env.settings.clone()).await;
    let r = reqwest::get(format!("{}/metrics", api.base)).await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "NOT_FOUND");
    // The balancer's checks say ready or not, and nothing else.
    for path in ["/healthz", "/readyz"] {
        let r = reqwest::get(format!("{}{path}", api.base)).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        let text = r.text().await.unwrap();
        assert!(["ok", "ready"].contains(&text.as_str()), "{path}: {text}");
    }
    let m = reqwest::get(format!("{}/metrics", api.ops)).await.unwrap();
    assert_eq!(m.status(), StatusCode::OK);
    assert!(m.text().await.unwrap().contains("http_connections_open"));
    api.stop.cancel();
    env.cleanup().await;
}

const ADMIN_TOKEN: &str = "front-door-admin-token-0123456789abcdef";

/// A client whose connections come from `ip` (any address of 127.0.0.0/8 is this host).
fn client_from(ip: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(IpAddr::from(ip))
        .build()
        .unwrap()
}

async fn status_as(client: &reqwest::Client, url: &str, token: &str) -> StatusCode {
    client
        .get(url)
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .unwrap()
        .status()
}

/// `admin_auth_failures_total{result}` of this process.
fn failures(result: &str) -> u64 {
    let metrics = seckill::telemetry::metrics_handle().render();
    let prefix = format!("admin_auth_failures_total{{result=\"{result}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guessing_the_admin_token_is_throttled_and_the_right_token_still_gets_in() {
    const GUESSES: usize = 300;
    const AT_ONCE: usize = 20;
    let env = TestEnv::without_topics().await;
    env.activity(974, 1, 10).await;
    let api = common::start_with_admin(&env, ADMIN_TOKEN).await;
    let (admin, stop) = (api.admin, api.stop);
    let url = format!("{admin}/admin/v1/sales/974");
    let attacker = client_from([127, 0, 0, 1]);
    let operator = client_from([127, 0, 0, 2]);

    // 300 wrong tokens of every length, 20 at a time, from one address.
    let started = Instant::now();
    let (attacker_c, url_c) = (attacker.clone(), url.clone());
    let guesses = futures::stream::iter(0..GUESSES).map(move |i| {
        let (attacker, url) = (attacker_c.clone(), url_c.clone());
        async move { status_as(&attacker, &url, &"x".repeat(1 + i % 64)).await }
    });
    let attack =
        tokio::spawn(async move { guesses.buffer_unordered(AT_ONCE).collect::<Vec<_>>().await });
    // Meanwhile the operator, from their own host, gets in at once.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        status_as(&operator, &url, ADMIN_TOKEN).await,
        StatusCode::OK
    );
    let answers = attack.await.unwrap();
    let took = started.elapsed();
    let count = |s: StatusCode| answers.iter().filter(|a| **a == s).count();
    let (refused, throttled) = (
        count(StatusCode::UNAUTHORIZED),
        count(StatusCode::TOO_MANY_REQUESTS),
    );
    let (busy, tarpit, full) = (failures("busy"), failures("tarpit"), failures("throttled"));
    eprintln!(
        "{GUESSES} wrong admin tokens in {took:?}: {refused} answered 401, {throttled} 429 \
         ({busy} refused without a comparison while the address had one in flight, {tarpit} \
         tarpitted, {full} refused with the tarpit full)"
    );
    assert_eq!(refused + throttled, GUESSES, "every guess was refused");
    assert_eq!(
        refused, 5,
        "an address's first five failures are plain 401s"
    );
    // Past them, the address gets one comparison at a time, each held in the tarpit: most
    // guesses are never compared at all.
    assert!(
        busy as usize >= GUESSES - 5 - AT_ONCE - 10,
        "{busy} of {GUESSES} guesses refused uncompared"
    );
    // The right token is not locked out, not even from the guesser's own address.
    assert_eq!(
        status_as(&attacker, &url, ADMIN_TOKEN).await,
        StatusCode::OK
    );
    stop.cancel();
    env.cleanup().await;
}
