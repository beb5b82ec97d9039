//! `seckill-bench verify`: what one buyer-token check costs, per algorithm, on one core.
//!
//! For each algorithm (the development HS256, and RS256, PS256, ES256, EdDSA from a JWKS of
//! keys generated here) it times, over the same distinct tokens:
//! - the signature check alone, through each of jsonwebtoken's two backends (RustCrypto, the
//!   pure-Rust one this project shipped first, and aws-lc-rs, the one it ships now);
//! - the API's whole check ([`BuyerAuth::verify`]: header, key, times, signature, claims) with
//!   the verified-token cache off, and with it on once every token has been seen.
//!
//! One line per algorithm, `VERIFY alg=… sig_rust_crypto_per_s=… sig_aws_lc_per_s=…
//! api_uncached_per_s=… api_cached_per_s=…`, then `VERIFY_RATIOS` with each algorithm's
//! aws-lc over RustCrypto signature rate and cached over uncached API rate.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use jsonwebtoken::crypto::CryptoProvider;
use jsonwebtoken::{Algorithm, DecodingKey};
use seckill::auth::buyer::{mint_dev, mint_with_key, BuyerAuth, TokenSpec};
use seckill::auth::jwks::KeySet;
use seckill::auth::keygen;
use seckill::config::Settings;

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Distinct tokens (one buyer each) checked in turn.
    #[arg(long, default_value_t = 1000)]
    tokens: usize,
    /// Seconds each measurement runs (at least one pass over the tokens).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Only these algorithms (comma-separated JOSE names); all five when empty.
    #[arg(long, default_value = "")]
    only: String,
}

/// One algorithm's figures, checks per second.
struct Figures {
    alg: Algorithm,
    sig_rust_crypto: f64,
    sig_aws_lc: f64,
    api_uncached: f64,
    api_cached: f64,
}

pub async fn run(settings: Settings, args: VerifyArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.tokens > 0, "--tokens must be at least 1");
    let budget = Duration::from_secs_f64(args.seconds.max(0.01));
    let dir = std::env::temp_dir().join(format!("seckill-bench-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let keys = keygen::ALGORITHMS
        .iter()
        .map(|&alg| keygen::generate(alg, &format!("bench-{alg:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let jwks_file = dir.join("jwks.json");
    std::fs::write(&jwks_file, keygen::jwks(&keys))?;
    let mut auth = settings.auth.clone();
    auth.jwks_file = jwks_file.display().to_string();
    auth.jwks_url = String::new();
    anyhow::ensure!(
        !secrecy::ExposeSecret::expose_secret(&auth.dev_hs256_secret).is_empty(),
        "auth.dev_hs256_secret is empty: the HS256 reference needs it (SECKILL_ENV=bench sets it)"
    );
    let keyset = KeySet::load_file(&jwks_file)?;
    let bench = Bench {
        settings: &settings,
        auth,
        keys,
        keyset,
        tokens: args.tokens,
        budget,
    };
    let only: Vec<String> = args
        .only
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_ascii_uppercase)
        .collect();
    let mut all = Vec::new();
    for alg in [Algorithm::HS256].into_iter().chain(keygen::ALGORITHMS) {
        if !only.is_empty() && !only.contains(&format!("{alg:?}").to_ascii_uppercase()) {
            continue;
        }
        let f = bench.measure(alg).await?;
        println!(
            "VERIFY alg={:?} sig_rust_crypto_per_s={:.0} sig_aws_lc_per_s={:.0} \
             api_uncached_per_s={:.0} api_cached_per_s={:.0} api_uncached_us={:.1}",
            f.alg,
            f.sig_rust_crypto,
            f.sig_aws_lc,
            f.api_uncached,
            f.api_cached,
            1e6 / f.api_uncached
        );
        all.push(f);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let ratios: Vec<String> = all
        .iter()
        .flat_map(|f| {
            let name = format!("{:?}", f.alg).to_ascii_lowercase();
            [
                format!(
                    "{name}_aws_lc_vs_rust_crypto={:.2}",
                    f.sig_aws_lc / f.sig_rust_crypto
                ),
                format!(
                    "{name}_cached_vs_uncached={:.1}",
                    f.api_cached / f.api_uncached
                ),
            ]
        })
        .collect();
    println!("VERIFY_RATIOS {}", ratios.join(" "));
    Ok(true)
}

/// The generated keys and what every algorithm's measurement shares.
struct Bench<'a> {
    settings: &'a Settings,
    /// The settings' auth with the generated keys' JWKS file.
    auth: seckill::config::AuthSettings,
    keys: Vec<keygen::SigningKey>,
    keyset: KeySet,
    tokens: usize,
    budget: Duration,
}

impl Bench<'_> {
    /// One algorithm: its signatures alone with each crypto provider, then the API's whole
    /// check with its token cache off and on.
    async fn measure(&self, alg: Algorithm) -> anyhow::Result<Figures> {
        let (auth, budget) = (&self.auth, self.budget);
        let spec = |user_id| TokenSpec {
            user_id,
            ttl: Duration::from_secs(3600),
            audience: &self.settings.auth.audience,
            issuer: &self.settings.auth.issuer,
        };
        let generated = self.keys.iter().find(|k| k.alg == alg);
        let tokens = (1..=self.tokens as i64)
            .map(|user| match generated {
                Some(k) => mint_with_key(alg, k.pem.as_bytes(), &k.kid, &spec(user)),
                None => mint_dev(&auth.dev_hs256_secret, &spec(user)),
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let key = match generated {
            Some(k) => self
                .keyset
                .get(&k.kid)
                .context("the generated key")?
                .1
                .clone(),
            None => DecodingKey::from_secret(
                secrecy::ExposeSecret::expose_secret(&auth.dev_hs256_secret).as_bytes(),
            )?,
        };
        let parts = split(&tokens)?;
        let rust_crypto = &jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER;
        let aws_lc = &jsonwebtoken::crypto::aws_lc::DEFAULT_PROVIDER;
        let sig_rust_crypto = signatures(rust_crypto, alg, &key, &parts, budget)?;
        let sig_aws_lc = signatures(aws_lc, alg, &key, &parts, budget)?;
        let mut uncached = auth.clone();
        uncached.token_cache_entries = 0;
        let api_uncached = api(&BuyerAuth::from_settings(&uncached)?, &tokens, budget).await?;
        let mut cached = auth.clone();
        cached.token_cache_entries = cached.token_cache_entries.max(self.tokens);
        let with_cache = BuyerAuth::from_settings(&cached)?;
        api(&with_cache, &tokens, Duration::ZERO).await?; // every token seen once
        let api_cached = api(&with_cache, &tokens, budget).await?;
        Ok(Figures {
            alg,
            sig_rust_crypto,
            sig_aws_lc,
            api_uncached,
            api_cached,
        })
    }
}

/// A token's signed part (`header.claims`) and its signature's bytes.
type Parts = Vec<(Vec<u8>, Vec<u8>)>;

fn split(tokens: &[String]) -> anyhow::Result<Parts> {
    use base64::Engine;
    tokens
        .iter()
        .map(|t| {
            let (message, signature) = t.rsplit_once('.').context("a JWT")?;
            let signature = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(signature)?;
            Ok((message.as_bytes().to_vec(), signature))
        })
        .collect()
}

/// Signature checks per second through `provider`, the verifier built per check as
/// jsonwebtoken does. A signature that does not verify is an error: the figure would be of
/// the refusal path.
fn signatures(
    provider: &CryptoProvider,
    alg: Algorithm,
    key: &DecodingKey,
    parts: &Parts,
    budget: Duration,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut done = 0u64;
    loop {
        for (message, signature) in parts {
            let verifier = (provider.verifier_factory)(&alg, key)?;
            jsonwebtoken::signature::Verifier::verify(&*verifier, message, signature)
                .map_err(|e| anyhow::anyhow!("{alg:?}: a good signature refused: {e}"))?;
            done += 1;
        }
        if start.elapsed() >= budget {
            return Ok(done as f64 / start.elapsed().as_secs_f64());
        }
    }
}

/// The API's whole check per second, over the tokens in turn.
async fn api(auth: &BuyerAuth, tokens: &[String], budget: Duration) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut done = 0u64;
    loop {
        for token in tokens {
            auth.verify(token)
                .await
                .map_err(|e| anyhow::anyhow!("a good token refused: {e:?}"))?;
            done += 1;
        }
        if start.elapsed() >= budget {
            return Ok(done as f64 / start.elapsed().as_secs_f64());
        }
    }
}
