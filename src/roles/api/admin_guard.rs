//! The admin listener's throttle of failed logins (docs/architecture/security.md#admin-surface).
//!
//! The admin token is at least 32 bytes, so guessing it is hopeless; the throttle keeps a
//! guesser from even trying at speed, and tells the operator someone is:
//!
//! - an address's first [`FREE_FAILURES`] wrong tokens are answered `401` at once, as a typo
//!   should be;
//! - past them the address is *throttled*: it gets one request in flight at a time (a second
//!   one at once is `429` without its token being looked at), and each wrong token is answered
//!   `429` only after a tarpit delay that doubles per failure up to [`MAX_DELAY`];
//! - when more than [`GLOBAL_FAILURES`] failures arrive within [`WINDOW`] from all addresses
//!   together (many addresses, each under its own threshold), every failing address is
//!   throttled from its first failure;
//! - tarpitted answers hold at most [`TARPIT_SLOTS`] connections in all; a wrong token past
//!   them is `429` at once, so the tarpit never fills the listener's connection slots.
//!
//! The right token is never delayed: it is compared first (in constant time, whatever its
//! length) and answered at once, from any address that has no request in flight, so neither a
//! guesser elsewhere nor one at the operator's own address can lock the operator out.
//! Failures are counted in `admin_auth_failures_total{result}` and logged with the address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tracing::warn;

/// Wrong tokens an address may send before it is throttled.
pub const FREE_FAILURES: u32 = 5;
/// Failures from all addresses within [`WINDOW`] past which every address is throttled.
pub const GLOBAL_FAILURES: u32 = 50;
/// How long failures are remembered: an address quiet this long starts afresh.
pub const WINDOW: Duration = Duration::from_secs(600);
/// The first tarpit delay; it doubles per further failure.
pub const FIRST_DELAY: Duration = Duration::from_millis(500);
/// The longest tarpit delay (under the admin listener's request timeout).
pub const MAX_DELAY: Duration = Duration::from_secs(4);
/// Tarpitted answers in flight at once, over all addresses.
pub const TARPIT_SLOTS: usize = 32;
/// Addresses remembered at once; past it, an unknown address counts only globally.
const MAX_TRACKED: usize = 4096;

/// What the guard says about a request before its token is compared.
#[derive(Debug)]
pub enum Admission {
    /// Compare the token; report the outcome with [`AdminGuard::settle`].
    Compare(Attempt),
    /// The address already has a request in flight while throttled: `429` without comparing.
    Busy,
}

/// One request's turn from its address: while held, a throttled address has no other.
#[derive(Debug)]
pub struct Attempt {
    ip: IpAddr,
    /// Whether this attempt holds its address's one in-flight turn.
    holds_turn: bool,
    guard: Arc<Inner>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.holds_turn {
            let mut state = self.guard.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(o) = state.offenders.get_mut(&self.ip) {
                o.in_flight = o.in_flight.saturating_sub(1);
            }
        }
    }
}

/// What to answer a wrong token.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `401` at once.
    Refused,
    /// `429` after this delay, the attempt and a tarpit slot held meanwhile; at once when
    /// every tarpit slot is taken.
    Tarpit(Duration),
}

#[derive(Debug, Default)]
struct Offender {
    failures: u32,
    last_failure: Option<Instant>,
    /// Requests of this address being answered now; a throttled address may have one.
    in_flight: u32,
}

#[derive(Debug, Default)]
struct State {
    offenders: HashMap<IpAddr, Offender>,
    /// Failures from every address in the current window, and when it began.
    global: u32,
    global_since: Option<Instant>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    tarpit: Arc<Semaphore>,
}

/// The throttle, shared by every request of the admin listener.
#[derive(Debug, Clone)]
pub struct AdminGuard(Arc<Inner>);

impl Default for AdminGuard {
    fn default() -> Self {
        Self(Arc::new(Inner {
            state: Mutex::default(),
            tarpit: Arc::new(Semaphore::new(TARPIT_SLOTS)),
        }))
    }
}

impl AdminGuard {
    /// Whether a request from `ip` may have its token compared.
    pub fn admit(&self, ip: IpAddr, now: Instant) -> Admission {
        let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        let global_throttle = state.global_throttled(now);
        let holds_turn = match state.offenders.get_mut(&ip) {
            Some(o) => {
                o.forget_if_quiet(now);
                let throttled = o.failures >= FREE_FAILURES || (global_throttle && o.failures > 0);
                if throttled && o.in_flight > 0 {
                    return Admission::Busy;
                }
                o.in_flight += 1;
                true
            }
            None => false,
        };
        Admission::Compare(Attempt {
            ip,
            holds_turn,
            guard: self.0.clone(),
        })
    }

    /// The right token: the address starts afresh.
    pub fn succeeded(&self, attempt: &Attempt) {
        let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = state.offenders.get_mut(&attempt.ip) {
            o.failures = 0;
            o.last_failure = None;
        }
    }

    /// A wrong token: counts it and says how to answer.
    pub fn failed(&self, attempt: &mut Attempt, now: Instant) -> Verdict {
        let mut state = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        let global_throttle = state.note_global(now);
        let tracked = state.offenders.len();
        if tracked >= MAX_TRACKED && !state.offenders.contains_key(&attempt.ip) {
            state
                .offenders
                .retain(|_, o| o.in_flight > 0 || o.last_failure.is_some_and(|t| now - t < WINDOW));
        }
        let failures =
            if state.offenders.len() < MAX_TRACKED || state.offenders.contains_key(&attempt.ip) {
                let o = state.offenders.entry(attempt.ip).or_default();
                o.forget_if_quiet(now);
                o.failures += 1;
                o.last_failure = Some(now);
                if !attempt.holds_turn {
                    // Its first failure: later attempts of this address take turns.
                    attempt.holds_turn = true;
                    o.in_flight += 1;
                }
                o.failures
            } else {
                // Too many addresses to remember: this one counts globally only.
                FREE_FAILURES + 1
            };
        drop(state);
        let throttled = failures > FREE_FAILURES || global_throttle;
        if failures == 1 || failures == FREE_FAILURES + 1 {
            warn!(
                address = %attempt.ip, failures, throttled,
                "admin listener: wrong admin token"
            );
        }
        if !throttled {
            return Verdict::Refused;
        }
        let over = failures.saturating_sub(FREE_FAILURES + 1).min(8);
        Verdict::Tarpit((FIRST_DELAY * 2u32.pow(over)).min(MAX_DELAY))
    }

    /// A tarpit slot for a throttled answer, if one is free.
    pub fn tarpit_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.tarpit.clone().try_acquire_owned().ok()
    }
}

impl Offender {
    fn forget_if_quiet(&mut self, now: Instant) {
        if self.last_failure.is_some_and(|t| now - t >= WINDOW) {
            self.failures = 0;
            self.last_failure = None;
        }
    }
}

impl State {
    fn global_throttled(&mut self, now: Instant) -> bool {
        if self.global_since.is_some_and(|t| now - t >= WINDOW) {
            self.global = 0;
            self.global_since = None;
        }
        self.global > GLOBAL_FAILURES
    }

    /// Counts one failure; whether the listener as a whole is now throttled.
    fn note_global(&mut self, now: Instant) -> bool {
        self.global_throttled(now);
        self.global_since.get_or_insert(now);
        self.global += 1;
        self.global > GLOBAL_FAILURES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn attempt(g: &AdminGuard, ip: IpAddr, now: Instant) -> Attempt {
        match g.admit(ip, now) {
            Admission::Compare(a) => a,
            Admission::Busy => panic!("{ip} refused as busy"),
        }
    }

    #[test]
    fn an_address_is_throttled_after_its_free_failures_and_takes_turns() {
        let g = AdminGuard::default();
        let now = Instant::now();
        for _ in 0..FREE_FAILURES {
            let mut a = attempt(&g, ip(1), now);
            assert_eq!(g.failed(&mut a, now), Verdict::Refused);
        }
        let mut a = attempt(&g, ip(1), now);
        // While it is in flight, the address gets no second turn...
        assert!(matches!(g.admit(ip(1), now), Admission::Busy));
        // ...other addresses are untouched.
        let mut other = attempt(&g, ip(2), now);
        assert_eq!(g.failed(&mut other, now), Verdict::Refused);
        assert_eq!(g.failed(&mut a, now), Verdict::Tarpit(FIRST_DELAY));
        drop(a);
        let mut b = attempt(&g, ip(1), now);
        assert_eq!(g.failed(&mut b, now), Verdict::Tarpit(FIRST_DELAY * 2));
        drop(b);
        // The right token passes from the throttled address, which starts afresh.
        let c = attempt(&g, ip(1), now);
        g.succeeded(&c);
        drop(c);
        let mut d = attempt(&g, ip(1), now);
        assert_eq!(g.failed(&mut d, now), Verdict::Refused);
    }

    #[test]
    fn delays_double_up_to_the_cap_and_quiet_addresses_are_forgiven() {
        let g = AdminGuard::default();
        let now = Instant::now();
        let mut last = Verdict::Refused;
        for _ in 0..FREE_FAILURES + 20 {
            let mut a = attempt(&g, ip(3), now);
            last = g.failed(&mut a, now);
        }
        assert_eq!(last, Verdict::Tarpit(MAX_DELAY));
        let later = now + WINDOW;
        let mut a = attempt(&g, ip(3), later);
        assert_eq!(g.failed(&mut a, later), Verdict::Refused);
    }

    #[test]
    fn many_addresses_together_throttle_everyone_from_the_first_failure() {
        let g = AdminGuard::default();
        let now = Instant::now();
        for i in 0..=GLOBAL_FAILURES {
            let ip = IpAddr::from([10, 1, (i / 256) as u8, (i % 256) as u8]);
            let mut a = attempt(&g, ip, now);
            g.failed(&mut a, now);
        }
        let mut a = attempt(&g, ip(200), now);
        assert!(matches!(g.failed(&mut a, now), Verdict::Tarpit(_)));
    }
}
