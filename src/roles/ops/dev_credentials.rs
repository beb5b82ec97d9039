//! Development credentials (docs/architecture/security.md#security-model): `seckill token mint`
//! signs a buyer token with the development HS256 secret (or, with `--key`, a private key as a
//! shop's login does), `seckill token keygen` makes such a key and the JWKS that publishes it,
//! `seckill payment sign` signs a payment notification the way the provider does. The demo, the
//! bench and the tests use them; the HS256 path and payment signing refuse when `env = "PROD"`,
//! where tokens come from the shop's login and notifications from the payment provider only.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use secrecy::ExposeSecret;

use crate::auth::buyer::{mint_dev, mint_with_key, TokenSpec};
use crate::auth::signature::sign;
use crate::config::Settings;

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Print a buyer token: signed with `--key` (a private key of `token keygen`), else a
    /// development one (HS256, `auth.dev_hs256_secret`; refused in PROD).
    Mint(MintArgs),
    /// Write a new signing key (PKCS#8 PEM, mode 0600) and the JWKS publishing its public
    /// half, for `auth.jwks_file` or a test identity provider.
    Keygen(KeygenArgs),
}

#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// RS256 (default), PS256, ES256 or EdDSA.
    #[arg(long, default_value = "RS256")]
    pub alg: String,
    /// The key's `kid`.
    #[arg(long)]
    pub kid: String,
    /// Where the private key goes (must not exist).
    #[arg(long)]
    pub key_out: std::path::PathBuf,
    /// Where the JWKS goes (replaced).
    #[arg(long)]
    pub jwks_out: std::path::PathBuf,
}

#[derive(Debug, Args)]
pub struct MintArgs {
    /// The buyer (`sub`).
    #[arg(long)]
    pub user: i64,
    /// Seconds the token stays valid.
    #[arg(long, default_value_t = 3600)]
    pub ttl: u64,
    /// Sign with this private key (PKCS#8 PEM) instead of the development secret.
    #[arg(long, requires = "kid")]
    pub key: Option<std::path::PathBuf>,
    /// The `kid` of `--key` in the JWKS.
    #[arg(long, requires = "key")]
    pub kid: Option<String>,
    /// The algorithm of `--key`: RS256 (default), PS256, ES256 or EdDSA.
    #[arg(long, default_value = "RS256")]
    pub alg: String,
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
    if args.user <= 0 {
        bail!("--user must be a positive buyer id");
    }
    let spec = TokenSpec {
        user_id: args.user,
        ttl: Duration::from_secs(args.ttl),
        audience: &settings.auth.audience,
        issuer: &settings.auth.issuer,
    };
    if let (Some(key), Some(kid)) = (&args.key, &args.kid) {
        let alg = algorithm(&args.alg)?;
        let pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
        println!("{}", mint_with_key(alg, &pem, kid, &spec)?);
        return Ok(());
    }
    refuse_in_prod(settings, "token mint")?;
    if settings.auth.dev_hs256_secret.expose_secret().is_empty() {
        bail!("auth.dev_hs256_secret is empty: no development key to sign with");
    }
    println!("{}", mint_dev(&settings.auth.dev_hs256_secret, &spec)?);
    Ok(())
}

fn algorithm(name: &str) -> anyhow::Result<jsonwebtoken::Algorithm> {
    crate::auth::keygen::parse_algorithm(name)
        .ok_or_else(|| anyhow::anyhow!("--alg {name}: RS256, PS256, ES256 or EdDSA"))
}

/// `seckill token keygen`: a private key file and its JWKS.
pub fn keygen(args: &KeygenArgs) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let key = crate::auth::keygen::generate(algorithm(&args.alg)?, &args.kid)?;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&args.key_out)
        .with_context(|| format!("creating {}", args.key_out.display()))?;
    out.write_all(key.pem.as_bytes())?;
    std::fs::write(&args.jwks_out, crate::auth::keygen::jwks([&key]))
        .with_context(|| format!("writing {}", args.jwks_out.display()))?;
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
