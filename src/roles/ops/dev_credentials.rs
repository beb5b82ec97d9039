//! Development credentials (docs/ARCHITECTURE.md#security-model): `seckill token mint` signs a
//! buyer token with the development HS256 secret, `seckill payment sign` signs a payment
//! notification the way the provider does. The demo, the bench and the tests use them; both
//! refuse when `env = "PROD"`, where tokens come from the shop's login and notifications from
//! the payment provider only.

use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use secrecy::ExposeSecret;

use crate::auth::buyer::{mint_dev, TokenSpec};
use crate::auth::signature::sign;
use crate::config::Settings;

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Print a development buyer token (HS256, `auth.dev_hs256_secret`); refused in PROD.
    Mint(MintArgs),
}

#[derive(Debug, Args)]
pub struct MintArgs {
    /// The buyer (`sub`).
    #[arg(long)]
    pub user: i64,
    /// Seconds the token stays valid.
    #[arg(long, default_value_t = 3600)]
    pub ttl: u64,
}

#[derive(Debug, Subcommand)]
pub enum PaymentCommand {
    /// Print the `Seckill-Signature` header value for a notification body, signed with the
    /// first of `payments.webhook_secrets` (what the provider sends); refused in PROD.
    Sign(SignArgs),
}

#[derive(Debug, Args)]
pub struct SignArgs {
    /// The exact notification body, e.g. '{"order_id":"ord_…","payment_id":"pay-1","amount_cents":100}'.
    #[arg(long)]
    pub body: String,
    /// Unix seconds to sign at (default: now).
    #[arg(long)]
    pub at: Option<i64>,
}

fn refuse_in_prod(settings: &Settings, what: &str) -> anyhow::Result<()> {
    if settings.env == "PROD" {
        bail!("{what} is for development: refused when env = \"PROD\"");
    }
    Ok(())
}

/// `seckill token mint`: the token on stdout.
pub fn mint(settings: &Settings, args: &MintArgs) -> anyhow::Result<()> {
    refuse_in_prod(settings, "token mint")?;
    if settings.auth.dev_hs256_secret.expose_secret().is_empty() {
        bail!("auth.dev_hs256_secret is empty: no development key to sign with");
    }
    if args.user <= 0 {
        bail!("--user must be a positive buyer id");
    }
    let spec = TokenSpec {
        user_id: args.user,
        ttl: Duration::from_secs(args.ttl),
        audience: &settings.auth.audience,
        issuer: &settings.auth.issuer,
    };
    println!("{}", mint_dev(&settings.auth.dev_hs256_secret, &spec)?);
    Ok(())
}

/// `seckill payment sign`: the header value on stdout.
pub fn sign_notification(settings: &Settings, args: &SignArgs) -> anyhow::Result<()> {
    refuse_in_prod(settings, "payment sign")?;
    let Some(secret) = settings.payments.webhook_secrets.first() else {
        bail!("payments.webhook_secrets is empty: no secret to sign with");
    };
    let at = args.at.unwrap_or_else(|| chrono::Utc::now().timestamp());
    println!("{}", sign(secret, at, args.body.as_bytes()));
    Ok(())
}
