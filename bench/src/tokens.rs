//! The buyers' tokens the load generators send: signed with a private key from `seckill token
//! keygen` (RS256 unless told otherwise), the way a shop's identity provider signs them, with
//! the API given only the JWKS (`auth.jwks_file`). Without a key, the development HS256
//! tokens, which production refuses: a figure measured with those is labelled as such.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use jsonwebtoken::Algorithm;
use seckill::auth::buyer::{mint_dev, mint_with_key, TokenSpec};
use seckill::auth::keygen;
use seckill::config::Settings;

/// How the buyers' tokens are signed; the environment variables let a script set it once for
/// every generator it runs.
#[derive(Debug, Clone, Args)]
pub struct SigningArgs {
    /// Private key (PKCS#8 PEM) the buyers' tokens are signed with; empty: development HS256.
    #[arg(long, env = "SECKILL_BENCH_SIGNING_KEY", default_value = "")]
    pub signing_key: String,
    /// The key's `kid`, as published in the API's JWKS.
    #[arg(long, env = "SECKILL_BENCH_SIGNING_KID", default_value = "")]
    pub signing_kid: String,
    /// The key's algorithm: RS256, PS256, ES256 or EdDSA.
    #[arg(long, env = "SECKILL_BENCH_SIGNING_ALG", default_value = "RS256")]
    pub signing_alg: String,
}

/// Buyers with their `Bearer <token>` values.
type Bearers = Vec<(i64, Arc<str>)>;

/// Signs buyer tokens for one generator run.
pub struct Minter {
    key: Option<(Algorithm, Vec<u8>, String)>,
    settings: Settings,
}

impl Minter {
    pub fn new(settings: &Settings, args: &SigningArgs) -> anyhow::Result<Self> {
        let key = if args.signing_key.is_empty() {
            None
        } else {
            let alg = keygen::parse_algorithm(&args.signing_alg)
                .with_context(|| format!("--signing-alg {}: unknown", args.signing_alg))?;
            anyhow::ensure!(!args.signing_kid.is_empty(), "--signing-kid is needed");
            let pem = std::fs::read(&args.signing_key)
                .with_context(|| format!("reading --signing-key {}", args.signing_key))?;
            Some((alg, pem, args.signing_kid.clone()))
        };
        Ok(Self {
            key,
            settings: settings.clone(),
        })
    }

    /// `RS256`, …, or `HS256-dev` for the development tokens.
    pub fn label(&self) -> String {
        match &self.key {
            Some((alg, _, _)) => format!("{alg:?}"),
            None => "HS256-dev".into(),
        }
    }

    /// A token for `user_id`, valid for an hour.
    pub fn mint(&self, user_id: i64) -> anyhow::Result<String> {
        let a = &self.settings.auth;
        let spec = TokenSpec {
            user_id,
            ttl: Duration::from_secs(3600),
            audience: &a.audience,
            issuer: &a.issuer,
        };
        match &self.key {
            Some((alg, pem, kid)) => mint_with_key(*alg, pem, kid, &spec),
            None => mint_dev(&a.dev_hs256_secret, &spec),
        }
    }

    /// `Bearer <token>` for each buyer, signed on every core before the clock starts (an RSA
    /// signature costs about a millisecond).
    pub fn bearer_for(&self, users: &[i64]) -> anyhow::Result<HashMap<i64, Arc<str>>> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let chunk = users.len().div_ceil(threads).max(1);
        let parts: Vec<anyhow::Result<Bearers>> = std::thread::scope(|scope| {
            let handles: Vec<_> = users
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|&u| Ok((u, format!("Bearer {}", self.mint(u)?).into())))
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a signing thread"))
                .collect()
        });
        let mut out = HashMap::with_capacity(users.len());
        for part in parts {
            out.extend(part?);
        }
        Ok(out)
    }
}

/// Writes `Bearer` values for `users` to `path`, one `user_id value` per line: minted once for
/// generators run one after another on the same buyers (`seckill-bench load --tokens-file`).
pub fn write_tokens_file(minter: &Minter, users: &[i64], path: &Path) -> anyhow::Result<()> {
    let tokens = minter.bearer_for(users)?;
    let mut text = String::with_capacity(tokens.len() * 700);
    for u in users {
        text.push_str(&format!("{u} {}\n", tokens[u]));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Reads what [`write_tokens_file`] wrote.
pub fn read_tokens_file(path: &Path) -> anyhow::Result<HashMap<i64, Arc<str>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (user, value) = l
                .split_once(' ')
                .with_context(|| format!("{}: a line without a token", path.display()))?;
            Ok((user.parse()?, value.into()))
        })
        .collect()
}

impl Provisioned {
    /// The arguments a generator signs with this key.
    pub fn signing_args(&self) -> SigningArgs {
        SigningArgs {
            signing_key: self.key_file.display().to_string(),
            signing_kid: self.kid.clone(),
            signing_alg: format!("{:?}", self.alg),
        }
    }
}

/// A signing key generated into `dir` for a run, and the JWKS publishing it: what a script
/// hands the API (`SECKILL__AUTH__JWKS_FILE`) and the generators (`SECKILL_BENCH_SIGNING_*`).
pub struct Provisioned {
    pub alg: Algorithm,
    pub kid: String,
    pub key_file: PathBuf,
    pub jwks_file: PathBuf,
}

impl Provisioned {
    /// One key per algorithm in `algs` (the first is the one the generators sign with unless
    /// told otherwise), all published in one JWKS.
    pub fn generate(dir: &Path, algs: &[Algorithm]) -> anyhow::Result<Vec<Provisioned>> {
        std::fs::create_dir_all(dir)?;
        let keys = algs
            .iter()
            .map(|&alg| {
                keygen::generate(alg, &format!("bench-{}", format!("{alg:?}").to_lowercase()))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let jwks_file = dir.join("jwks.json");
        std::fs::write(&jwks_file, keygen::jwks(&keys))?;
        keys.into_iter()
            .map(|k| {
                let key_file = dir.join(format!("{}.pem", k.kid));
                std::fs::write(&key_file, &k.pem)?;
                Ok(Provisioned {
                    alg: k.alg,
                    kid: k.kid,
                    key_file,
                    jwks_file: jwks_file.clone(),
                })
            })
            .collect()
    }

    /// The generators' environment for signing with this key.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "SECKILL_BENCH_SIGNING_KEY".into(),
                self.key_file.display().to_string(),
            ),
            ("SECKILL_BENCH_SIGNING_KID".into(), self.kid.clone()),
            (
                "SECKILL_BENCH_SIGNING_ALG".into(),
                format!("{:?}", self.alg),
            ),
        ]
    }
}
