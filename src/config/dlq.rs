//! `[dlq]`: the ticket hook (docs/RUNBOOK.md#dead-letter-tickets). Each new group of failures
//! (`seckill dlq groups`) is posted once to `ticket_webhook`, signed with `ticket_secret`, with
//! the owner `owners` names for its consumer group.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct DlqSettings {
    /// Where a new group's ticket is POSTed (`http(s)://...`); empty: no tickets.
    #[serde(default)]
    pub ticket_webhook: String,
    /// Signs each POST (`seckill-signature: t=<unix>,v1=<HMAC-SHA256 hex>`, as payment
    /// notifications are signed); at least 16 bytes when the hook is set.
    #[serde(default = "no_secret")]
    pub ticket_secret: SecretString,
    /// The owner of each consumer group's failures: `GROUP=owner` pairs separated by commas.
    #[serde(default)]
    pub owners: String,
    /// The owner of a group `owners` does not name.
    #[serde(default = "default_owner")]
    pub default_owner: String,
}

fn no_secret() -> SecretString {
    SecretString::from(String::new())
}

fn default_owner() -> String {
    "seckill-oncall".to_string()
}

impl DlqSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.owner_map()?;
        if self.ticket_webhook.is_empty() {
            return Ok(());
        }
        let url = reqwest::Url::parse(&self.ticket_webhook)
            .map_err(|e| ConfigError::invalid("dlq.ticket_webhook", e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ConfigError::invalid(
                "dlq.ticket_webhook",
                "must be an http:// or https:// URL",
            ));
        }
        if self.ticket_secret.expose_secret().len() < 16 {
            return Err(ConfigError::invalid(
                "dlq.ticket_secret",
                "at least 16 bytes when dlq.ticket_webhook is set",
            ));
        }
        Ok(())
    }

    /// `owners` as (consumer group, owner) pairs.
    pub fn owner_map(&self) -> Result<Vec<(String, String)>, ConfigError> {
        self.owners
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|pair| match pair.split_once('=') {
                Some((g, o)) if !g.trim().is_empty() && !o.trim().is_empty() => {
                    Ok((g.trim().to_string(), o.trim().to_string()))
                }
                _ => Err(ConfigError::invalid(
                    "dlq.owners",
                    format!("`{pair}` is not GROUP=owner"),
                )),
            })
            .collect()
    }

    /// The owner of `consumer_group`'s failures.
    pub fn owner_of(&self, consumer_group: &str) -> String {
        self.owner_map()
            .unwrap_or_default()
            .into_iter()
            .find(|(g, _)| g == consumer_group)
            .map_or_else(|| self.default_owner.clone(), |(_, o)| o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(webhook: &str, secret: &str, owners: &str) -> DlqSettings {
        DlqSettings {
            ticket_webhook: webhook.into(),
            ticket_secret: SecretString::from(secret.to_string()),
            owners: owners.into(),
            default_owner: default_owner(),
        }
    }

    fn key_of(s: &DlqSettings) -> Option<&'static str> {
        match s.validate() {
            Err(ConfigError::Invalid { key, .. }) => Some(key),
            _ => None,
        }
    }

    #[test]
    fn a_bad_hook_fails_naming_its_key_and_owners_map_groups() {
        let secret = "a-secret-of-16-bytes-or-more";
        assert_eq!(key_of(&with("", "", "")), None, "no hook, nothing needed");
        assert_eq!(
            key_of(&with("ftp://x", secret, "")),
            Some("dlq.ticket_webhook")
        );
        assert_eq!(
            key_of(&with("not a url", secret, "")),
            Some("dlq.ticket_webhook")
        );
        assert_eq!(
            key_of(&with("https://t.example/h", "short", "")),
            Some("dlq.ticket_secret")
        );
        assert_eq!(key_of(&with("", "", "CG_A")), Some("dlq.owners"));
        let s = with("http://127.0.0.1:9/h", secret, "CG_A=team-a, CG_B = team-b");
        assert_eq!(key_of(&s), None);
        assert_eq!(s.owner_of("CG_B"), "team-b");
        assert_eq!(s.owner_of("CG_C"), "seckill-oncall");
    }
}
