# Shared by scripts/demo.sh, demo-cluster.sh, soak.sh and chaos.sh (sourced, not run): the buyers'
# tokens as a shop's identity provider issues them. `production_tokens DIR` writes a new signing
# key and its JWKS under DIR (`seckill token keygen`), gives the JWKS to every seckill process
# started afterwards (SECKILL__AUTH__JWKS_FILE) and has seckill-bench sign with the key
# (SECKILL_BENCH_SIGNING_*). The algorithm is TOKEN_ALG: RS256 (default), PS256, ES256, EdDSA.
# Expects BIN (the seckill binary).
production_tokens() {
  local dir="$1" alg="${TOKEN_ALG:-RS256}"
  local kid key="$dir/buyer-signer.pem"
  kid="shop-$(echo "$alg" | tr '[:upper:]' '[:lower:]')-$(date +%s)"
  mkdir -p "$dir"
  rm -f "$key"
  "$BIN" token keygen --alg "$alg" --kid "$kid" --key-out "$key" --jwks-out "$dir/jwks.json" >/dev/null
  export SECKILL__AUTH__JWKS_FILE="$dir/jwks.json"
  export SECKILL_BENCH_SIGNING_KEY="$key" SECKILL_BENCH_SIGNING_KID="$kid" SECKILL_BENCH_SIGNING_ALG="$alg"
}
