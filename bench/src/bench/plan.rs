//! The request plan: who asks for what, with which request id and token.

use std::collections::{BTreeMap, HashSet};

use rand::Rng;

use super::{BenchArgs, Planned};
use crate::tokens::Minter;
use seckill::config::Settings;

/// Gives every planned request its buyer's token (one token per buyer, as a shop's login
/// would hand out), signed before the clock starts.
pub(super) fn with_tokens(
    settings: &Settings,
    minter: &Minter,
    plan: &mut [Planned],
) -> anyhow::Result<()> {
    if settings.auth.buyers != seckill::config::BuyerIdentity::Token {
        return Ok(());
    }
    let users: Vec<i64> = plan
        .iter()
        .map(|p| p.user_id)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let tokens = minter.bearer_for(&users)?;
    for p in plan.iter_mut() {
        p.auth = tokens.get(&p.user_id).cloned();
    }
    Ok(())
}

/// Builds the request plan: fresh buyers, repeat buyers and repeated requests, shuffled in time.
pub(super) fn plan(args: &BenchArgs, run_tag: &str) -> Vec<Planned> {
    let mut rng = rand::rng();
    let mut out: Vec<Planned> = Vec::with_capacity(args.requests);
    let mut next_user: i64 = 1;
    for i in 0..args.requests {
        if !out.is_empty() && rng.random_bool(args.dup_request_share.clamp(0.0, 1.0)) {
            let prev = out[rng.random_range(0..out.len())].clone();
            out.push(prev);
            continue;
        }
        let fresh_left = (next_user as usize) <= args.buyers;
        let repeat = next_user > 1
            && (!fresh_left || rng.random_bool(args.repeat_buyer_share.clamp(0.0, 1.0)));
        let user_id = if repeat {
            rng.random_range(1..next_user)
        } else {
            next_user += 1;
            next_user - 1
        };
        out.push(Planned {
            user_id,
            sku_id: args.sku_id + rng.random_range(0..args.skus.max(1)),
            request_id: format!("{run_tag}-{i}"),
            auth: None,
        });
    }
    out
}

/// Distinct buyers asking for each SKU of the plan (one reservation per buyer per SKU).
pub(super) fn buyers_per_sku(plan: &[Planned]) -> BTreeMap<i64, usize> {
    let mut pairs: BTreeMap<i64, HashSet<i64>> = BTreeMap::new();
    for p in plan {
        pairs.entry(p.sku_id).or_default().insert(p.user_id);
    }
    pairs
        .into_iter()
        .map(|(sku, users)| (sku, users.len()))
        .collect()
}

/// What a sale without faults must accept: min(stock, distinct buyers) for every SKU.
pub(super) fn expected_accepted(
    buyers: &BTreeMap<i64, usize>,
    stock: &BTreeMap<i64, i64>,
) -> usize {
    buyers
        .iter()
        .map(|(sku, &n)| n.min(stock.get(sku).copied().unwrap_or(0).max(0) as usize))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(requests: usize, buyers: usize, dup: f64, repeat: f64) -> BenchArgs {
        BenchArgs {
            api: String::new(),
            activity_id: 1,
            sku_id: 1,
            skus: 1,
            rate: None,
            cpu: Vec::new(),
            scenario: "test".into(),
            requests,
            buyers,
            concurrency: 1,
            dup_request_share: dup,
            repeat_buyer_share: repeat,
            drain_timeout_secs: 1,
            pay_share: 0.0,
            settle_timeout_secs: 1,
            json: false,
            tolerate_faults: false,
            load_only: false,
            stock: None,
            summary_prefix: "BENCH".into(),
            signing: crate::tokens::SigningArgs {
                signing_key: String::new(),
                signing_kid: String::new(),
                signing_alg: String::new(),
            },
        }
    }

    #[test]
    fn plan_respects_buyers_and_shares() {
        let p = plan(&args(10_000, 2_000, 0.0, 0.0), "t");
        assert_eq!(p.len(), 10_000);
        let users: HashSet<i64> = p.iter().map(|x| x.user_id).collect();
        assert!(p.iter().all(|x| x.sku_id == 1));
        assert_eq!(users.len(), 2_000);
        assert!(p.iter().all(|x| (1..=2_000).contains(&x.user_id)));
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert_eq!(
            reqs.len(),
            10_000,
            "no repeated request ids without dup share"
        );

        let p = plan(&args(10_000, 10_000, 0.5, 0.0), "t");
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert!(
            reqs.len() < 6_000,
            "about half repeat an earlier request: {}",
            reqs.len()
        );
    }

    #[test]
    fn many_skus_spread_the_plan_over_consecutive_ids() {
        let mut a = args(1000, 1000, 0.0, 0.0);
        a.sku_id = 10;
        a.skus = 4;
        let p = plan(&a, "t");
        let skus: HashSet<i64> = p.iter().map(|x| x.sku_id).collect();
        assert_eq!(skus, HashSet::from([10, 11, 12, 13]));
    }
}
