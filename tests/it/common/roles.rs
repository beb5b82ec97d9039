//! The long-running roles as child processes, each on free ports: one builder for every test
//! that runs a fleet (the fault tests start api, scan, consumers and timeout-cancel each with
//! its own variables and failpoints).

use super::*;

/// A role to start: its subcommand, the variable its readiness listener is set by, its
/// failpoints and extra variables.
pub struct Role {
    args: Vec<String>,
    listen_key: &'static str,
    failpoints: String,
    vars: Vec<(&'static str, String)>,
}

/// A started role: the process, the port it answers `/readyz` and `/metrics` on, and for the
/// API the buyers' port.
pub struct Started {
    pub proc: Proc,
    /// `/readyz` and `/metrics`.
    pub ops: u16,
    /// The API's buyers' port (`ops` for the other roles).
    pub port: u16,
}

impl Role {
    fn new(args: &[&str], listen_key: &'static str) -> Self {
        Self {
            args: args.iter().map(|a| a.to_string()).collect(),
            listen_key,
            failpoints: String::new(),
            vars: Vec::new(),
        }
    }

    /// `seckill api`, its buyers' and ops listeners on two free ports.
    pub fn api() -> Self {
        Self::new(&["api"], "SECKILL__API__METRICS_LISTEN")
    }

    pub fn scan() -> Self {
        Self::new(&["scan"], "SECKILL__SCAN__METRICS_LISTEN")
    }

    /// `seckill consume --workers <workers>`.
    pub fn consume(workers: usize) -> Self {
        Self::new(
            &["consume", "--workers", &workers.to_string()],
            "SECKILL__CONSUMER__METRICS_LISTEN",
        )
    }

    pub fn timeout_cancel() -> Self {
        Self::new(&["timeout-cancel"], "SECKILL__TIMEOUT__METRICS_LISTEN")
    }

    /// `FAILPOINTS` of the process (builds with the feature only).
    pub fn failpoints(mut self, failpoints: &str) -> Self {
        self.failpoints = failpoints.to_string();
        self
    }

    /// One more environment variable.
    pub fn var(mut self, key: &'static str, value: impl ToString) -> Self {
        self.vars.push((key, value.to_string()));
        self
    }

    /// Several more, as the fault tests pass them through.
    pub fn vars(mut self, vars: &[(&'static str, String)]) -> Self {
        self.vars.extend(vars.iter().cloned());
        self
    }

    /// Spawned, not waited for: see [`ready`].
    pub fn spawn(self, env: &TestEnv) -> Started {
        let ops = free_port();
        let mut vars = vec![(self.listen_key, format!("127.0.0.1:{ops}"))];
        let port = if self.args[0] == "api" {
            let port = free_port();
            vars.push(("SECKILL__API__LISTEN", format!("127.0.0.1:{port}")));
            port
        } else {
            ops
        };
        vars.extend(self.vars);
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        Started {
            proc: spawn(env, &args, &self.failpoints, &vars),
            ops,
            port,
        }
    }
}

impl Started {
    /// The API's base URL (`http://127.0.0.1:<port>`).
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Waits until each role answers `/readyz`.
pub async fn ready<'a>(roles: impl IntoIterator<Item = &'a Started>) {
    for r in roles {
        wait_ready(format!("http://127.0.0.1:{}/readyz", r.ops)).await;
    }
}
