#!/usr/bin/env bash
# The upgrade rule made mechanical (docs/ARCHITECTURE.md#upgrades): expand, deploy, contract.
# During a rolling deploy the previous release's roles run against the new schema, so a
# migration may drop or rename a table or a column only once no code of the previous release
# reads it. For every migration added since the previous release tag (the newest v* tag that is
# not on HEAD), each
#   DROP TABLE t | DROP COLUMN c | RENAME TO t | RENAME [COLUMN] c TO d
# names an identifier; if the previous release's src/ still has it as a word, the check fails
# and says where. Constraints and indexes are not the code's business and are not checked.
#
#   scripts/check-migrations.sh              check this checkout against its newest v* tag
#   scripts/check-migrations.sh --self-test  the check against a scratch repository: a drop
#                                            the previous release reads fails, one it does not
#                                            read passes
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The identifiers a migration drops or renames away, one per line.
removed_identifiers() {
  sed 's/--.*$//' "$1" | tr '\n' ' ' | tr ';' '\n' | tr '[:upper:]' '[:lower:]' |
    sed -nE \
      -e 's/.*drop table (if exists )?"?([a-z_][a-z0-9_]*)"?.*/\2/p' \
      -e 's/.*drop column (if exists )?"?([a-z_][a-z0-9_]*)"?.*/\2/p' \
      -e 's/.*alter table (if exists )?"?([a-z_][a-z0-9_]*)"? rename to .*/\2/p' \
      -e 's/.*rename column "?([a-z_][a-z0-9_]*)"? to .*/\1/p'
}

# check REPO: 0 when every new migration's removals are unread by the previous release.
check() {
  local repo="$1" tag failures=0
  # The release before this checkout: a tag on HEAD itself is this release, not the previous.
  tag="$(git -C "$repo" tag --list 'v*' --sort=-v:refname --no-contains HEAD | head -1)"
  if [[ -z "$tag" ]]; then
    echo "check-migrations: no release tag (v*) yet: nothing to compare with"
    return 0
  fi
  local added
  added="$(git -C "$repo" diff --name-only --diff-filter=A "$tag" -- sql/ | sort -V)"
  for m in $added; do
    [[ -f "$repo/$m" ]] || continue
    while read -r ident; do
      [[ -n "$ident" ]] || continue
      local readers
      readers="$(git -C "$repo" grep -n -w -i "$ident" "$tag" -- src 2>/dev/null | head -3 || true)"
      if [[ -n "$readers" ]]; then
        echo "check-migrations: $m removes \`$ident\`, which release $tag still reads:"
        sed 's/^/    /' <<<"$readers"
        echo "    expand now (add the new, write both), contract in a migration after the release"
        echo "    that stops reading it"
        failures=$((failures + 1))
      fi
    done < <(removed_identifiers "$repo/$m")
  done
  if ((failures > 0)); then
    return 1
  fi
  echo "check-migrations: migrations since $tag remove nothing release $tag reads ($(wc -w <<<"$added") new)"
}

self_test() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  git -C "$tmp" init -q
  git -C "$tmp" config user.email t@example.invalid
  git -C "$tmp" config user.name test
  mkdir -p "$tmp/src" "$tmp/sql"
  echo 'const Q: &str = "SELECT remaining_stock FROM activity_skus";' >"$tmp/src/lib.rs"
  echo 'CREATE TABLE activity_skus (sku_id bigint, remaining_stock int, legacy_note text);' >"$tmp/sql/V1__init.sql"
  git -C "$tmp" add -A && git -C "$tmp" commit -qm release && git -C "$tmp" tag v1.0.0
  # Not read by the release: the contract is safe.
  echo 'ALTER TABLE activity_skus DROP COLUMN legacy_note;' >"$tmp/sql/V2__contract.sql"
  git -C "$tmp" add -A && git -C "$tmp" commit -qm contract
  check "$tmp" >/dev/null || { echo "check-migrations self-test: a safe drop was refused"; return 1; }
  # Read by the release: the rolling deploy would break it.
  printf 'ALTER TABLE activity_skus\n  DROP COLUMN remaining_stock;\n' >"$tmp/sql/V3__drop.sql"
  git -C "$tmp" add -A && git -C "$tmp" commit -qm drop
  if check "$tmp" >/dev/null; then
    echo "check-migrations self-test: a drop the previous release reads was let through"
    return 1
  fi
  rm "$tmp/sql/V3__drop.sql"
  echo 'ALTER TABLE activity_skus RENAME TO skus;' >"$tmp/sql/V3__rename.sql"
  git -C "$tmp" add -A && git -C "$tmp" commit -qm rename
  if check "$tmp" >/dev/null; then
    echo "check-migrations self-test: a rename of a table the previous release reads was let through"
    return 1
  fi
  echo "check-migrations self-test: ok (a safe drop passes; a read column dropped, a read table renamed fail)"
}

if [[ "${1:-}" == --self-test ]]; then
  self_test
else
  check "$REPO_DIR"
fi
