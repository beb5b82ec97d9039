//! What one API instance keeps for sale passes (docs/architecture/hot-path.md#sale-passes),
//! held in `ApiState`; the routes that use it are in `passes`.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use crate::auth::pow::Pow;
use crate::config::Settings;
use crate::pg::passes::PassPolicy;

/// What PostgreSQL said of an activity's passes: no such activity (`None`), one sold without
/// passes (`Some(None)`), or its policy.
pub(super) type PolicyRead = Option<Option<PassPolicy>>;

/// What one API instance keeps for passes: the proof of work, the policies it read lately, and
/// which started activities require passes (fixed once the sale starts).
pub struct PassDesk {
    pub(super) secrets: Vec<secrecy::SecretString>,
    pub(super) pow: Pow,
    pub(super) policies: Mutex<HashMap<i64, (Instant, PolicyRead)>>,
    pub(super) required: RwLock<HashMap<i64, bool>>,
}

impl PassDesk {
    pub fn new(settings: &Settings) -> Self {
        let p = &settings.passes;
        Self {
            secrets: p.secrets.clone(),
            pow: Pow::new(&p.secrets, p.into()),
            policies: Mutex::default(),
            required: RwLock::default(),
        }
    }
}
