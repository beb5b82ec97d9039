//! The proof of work a pass registration may require (docs/architecture/hot-path.md#sale-passes):
//! an ALTCHA challenge (the `altcha` crate, PoW v2, deterministic mode), bound to one buyer and one
//! activity, whose work grows with the registrations this instance is asked for.
//!
//! The API picks a counter in `[d/2, d]` for difficulty `d` and hands out the challenge the
//! key it derives names; the client tries counters from 0 until one derives that key (about
//! `0.75 d` tries of `passes.pow_cost` SHA-256 rounds). Making a challenge costs the API one
//! derivation, checking a solution one HMAC. Nothing is stored: the challenge is signed, names
//! its buyer and activity, and expires; solving it once more gets the same buyer the pass they
//! already hold.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use altcha::{Challenge, CreateChallengeOptions, Payload, VerifySolutionOptions};
use rand::Rng as _;
use secrecy::SecretString;

use super::pass::derived_key;

/// Why a proof of work is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowFailure {
    /// No secret in use signed the challenge, or the solution does not derive its key.
    Invalid,
    /// Another buyer's or another activity's challenge.
    NotYours,
    /// Past the challenge's `expiresAt`.
    Expired,
}

impl PowFailure {
    pub fn label(self) -> &'static str {
        match self {
            PowFailure::Invalid => "invalid",
            PowFailure::NotYours => "not_yours",
            PowFailure::Expired => "expired",
        }
    }
}

/// How hard the work is and how it grows (the `[passes]` settings).
#[derive(Debug, Clone, Copy)]
pub struct PowTuning {
    /// SHA-256 rounds per counter tried.
    pub cost: u32,
    /// Seconds a challenge may be answered in.
    pub challenge_secs: u64,
    /// Challenges asked of this instance per second that double the difficulty (0: fixed).
    pub load_step_per_sec: u32,
    /// The most the load multiplies the activity's difficulty by.
    pub max_factor: u32,
}

impl From<&crate::config::PassSettings> for PowTuning {
    fn from(p: &crate::config::PassSettings) -> Self {
        Self {
            cost: p.pow_cost,
            challenge_secs: p.pow_challenge_secs,
            load_step_per_sec: p.pow_load_step_per_sec,
            max_factor: p.pow_max_factor,
        }
    }
}

/// Challenges made and checked by one API instance.
pub struct Pow {
    tuning: PowTuning,
    /// Per secret in use: (the challenge signing key, the derived-key signing key).
    keys: Vec<(String, String)>,
    /// Challenges asked in the current second and the one before: (second, now, before).
    load: Mutex<(u64, u32, u32)>,
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Pow {
    pub fn new(secrets: &[SecretString], tuning: PowTuning) -> Self {
        let keys = secrets
            .iter()
            .map(|s| {
                (
                    derived_key(s, "seckill pass pow challenge"),
                    derived_key(s, "seckill pass pow key"),
                )
            })
            .collect();
        Self {
            tuning,
            keys,
            load: Mutex::new((0, 0, 0)),
        }
    }

    /// Notes one challenge asked for; the load factor for it: 2^(asked last second / step),
    /// at most `max_factor`.
    fn note_asked(&self) -> u32 {
        let now = unix_secs();
        let Ok(mut l) = self.load.lock() else {
            return 1;
        };
        if l.0 != now {
            let before = if l.0 + 1 == now { l.1 } else { 0 };
            *l = (now, 0, before);
        }
        l.1 = l.1.saturating_add(1);
        let busiest = l.1.max(l.2);
        if self.tuning.load_step_per_sec == 0 {
            return 1;
        }
        let doublings = (busiest / self.tuning.load_step_per_sec).min(31);
        (1u32 << doublings).clamp(1, self.tuning.max_factor.max(1))
    }

    /// A challenge for `user_id` registering in `activity_id`, at the activity's base
    /// `difficulty` times the load factor; `None` without a secret. Returns the difficulty
    /// used with it.
    pub fn challenge(
        &self,
        activity_id: i64,
        user_id: i64,
        difficulty: u32,
    ) -> Option<(Challenge, u32)> {
        let (sign_key, key_key) = self.keys.first()?;
        let d = difficulty
            .max(2)
            .saturating_mul(self.note_asked())
            .min(u32::MAX / 2);
        let counter = rand::rng().random_range(d / 2..=d);
        let mut data = BTreeMap::new();
        data.insert("activity_id".to_string(), serde_json::json!(activity_id));
        data.insert("user_id".to_string(), serde_json::json!(user_id));
        let expires = unix_secs() + self.tuning.challenge_secs;
        let challenge = altcha::create_challenge(CreateChallengeOptions {
            algorithm: "SHA-256".to_string(),
            cost: self.tuning.cost.max(1),
            counter: Some(counter),
            data: Some(data),
            expires_at: Some(expires as i64),
            hmac_signature_secret: Some(sign_key.clone()),
            hmac_key_signature_secret: Some(key_key.clone()),
            ..Default::default()
        })
        .ok()?;
        metrics::gauge!("pass_pow_difficulty").set(f64::from(d));
        Some((challenge, d))
    }

    /// Whether `payload` solves a challenge this service made for this buyer and activity.
    pub fn verify(
        &self,
        payload: &Payload,
        activity_id: i64,
        user_id: i64,
    ) -> Result<(), PowFailure> {
        let mut expired = false;
        let solved = self.keys.iter().any(|(sign_key, key_key)| {
            let mut o = VerifySolutionOptions::new(&payload.challenge, &payload.solution, sign_key);
            o.hmac_key_signature_secret = Some(key_key.clone());
            match altcha::verify_solution(o) {
                Ok(r) => {
                    expired |= r.expired;
                    r.verified
                }
                Err(_) => false,
            }
        });
        if expired {
            return Err(PowFailure::Expired);
        }
        if !solved {
            return Err(PowFailure::Invalid);
        }
        // Signed, so the data is ours: it names whom the work was done for.
        let data = payload.challenge.parameters.data.as_ref();
        let named = |k: &str| data.and_then(|d| d.get(k)).and_then(|v| v.as_i64());
        if named("activity_id") != Some(activity_id) || named("user_id") != Some(user_id) {
            return Err(PowFailure::NotYours);
        }
        Ok(())
    }
}

/// Solves a challenge the way a client would (the tests and the benchmark's crowd); `None`
/// when no counter up to `u32::MAX` does.
pub fn solve(challenge: &Challenge) -> Option<Payload> {
    let mut o = altcha::SolveChallengeOptions::new(challenge);
    o.timeout_ms = 0;
    let solution = altcha::solve_challenge(o).ok().flatten()?;
    Some(Payload {
        challenge: challenge.clone(),
        solution,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pow(step: u32) -> Pow {
        let s = SecretString::from("pass-secret-of-at-least-32-bytes!!".to_string());
        Pow::new(
            &[s],
            PowTuning {
                cost: 1,
                challenge_secs: 60,
                load_step_per_sec: step,
                max_factor: 8,
            },
        )
    }

    #[test]
    fn a_solved_challenge_verifies_for_its_buyer_only() {
        let p = pow(0);
        let (c, d) = p.challenge(7, 42, 200).expect("a secret is set");
        assert_eq!(d, 200);
        let solved = solve(&c).expect("solvable");
        assert!((100..=200).contains(&solved.solution.counter));
        assert_eq!(p.verify(&solved, 7, 42), Ok(()));
        assert_eq!(p.verify(&solved, 7, 43), Err(PowFailure::NotYours));
        assert_eq!(p.verify(&solved, 8, 42), Err(PowFailure::NotYours));
        // A cheaper counter, or a challenge another secret signed, is no proof.
        let mut cheap = solved.clone();
        cheap.solution.counter = 0;
        cheap.solution.derived_key = "00".repeat(32);
        assert_eq!(p.verify(&cheap, 7, 42), Err(PowFailure::Invalid));
        let other = Pow::new(
            &[SecretString::from(
                "another-secret-of-at-least-32-bytes".to_string(),
            )],
            p.tuning,
        );
        assert_eq!(other.verify(&solved, 7, 42), Err(PowFailure::Invalid));
    }

    #[test]
    fn the_work_doubles_with_each_step_of_load() {
        let p = pow(5);
        let ds: Vec<u32> = (0..40).map(|_| p.challenge(7, 42, 10).unwrap().1).collect();
        // 1-4 asked: the base; 5-9: twice; 10-14: 4 times; then at most 8 times.
        assert_eq!(ds[0], 10);
        assert_eq!(ds[4], 20);
        assert_eq!(ds[9], 40);
        assert_eq!(*ds.last().unwrap(), 80);
    }
}
