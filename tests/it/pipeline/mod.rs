//! The hot path end to end on the real services (docs/architecture/hot-path.md): the API
//! in-process on port 0, the real RocketMQ producer and push consumer, PostgreSQL and Redis.
//! Each test has its own schema, key prefix and topics. One file per concern: `purchase` (a
//! reservation answered, sent and turned into one order, paid once; repeats, reused request
//! ids and sell-out answered and never oversold), `bad_input` (malformed bodies and paths get a
//! 400 and reach neither Redis nor the broker), `broker` (an unreachable broker, a missing
//! topic, a poison message, and admission pausing one activity whose sends wait too long).
//! What more than one of them uses is here.

mod bad_input;
mod broker;
mod purchase;

use crate::common;

use std::sync::Arc;

use crate::common::TestEnv;
use reqwest::StatusCode;
use seckill::mq::Publisher;
use seckill::roles::api::{build_state, serve, ApiState};
use seckill::roles::consume::order_create::OrderCreateHandler;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

struct Running {
    base: String,
    state: ApiState,
    stop: CancellationToken,
    consumer: Option<seckill::mq::rocketmq::ConsumerHandle>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        if let Some(c) = self.consumer {
            c.shutdown().await;
        }
    }
}

async fn start(env: &TestEnv, publisher: Arc<dyn Publisher>, with_consumer: bool) -> Running {
    let state = build_state(Arc::new(env.settings.clone()), publisher)
        .await
        .expect("api state");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(serve(listener, state.clone(), stop.clone()));
    let consumer = if with_consumer {
        let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
        Some(
            seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
                .await
                .expect("consumer starts"),
        )
    } else {
        None
    };
    Running {
        base,
        state,
        stop,
        consumer,
    }
}

/// A GET as buyer 1.
async fn get(url: String) -> (StatusCode, Value) {
    get_as(1, url).await
}

/// A GET as buyer `user`.
async fn get_as(user: i64, url: String) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .get(url)
        .header("authorization", common::bearer(user))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}
