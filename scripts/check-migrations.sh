#!/usr/bin/env bash
# The upgrade rule made mechanical (docs/architecture/postgresql.md#upgrades): expand, deploy,
# contract. During a rolling deploy the previous release's roles run against the new schema, so a
# migration may drop or rename a table or a column only once no code of the previous release reads
# it. For every migration added since the previous release (the newest one RELEASES records below
# HEAD: scripts/releases.sh; no tags needed), each
#   DROP TABLE t | DROP COLUMN c | RENAME TO t | RENAME [COLUMN] c TO d
# names an identifier; if the previous release's src/ still has it as a word, the check fails
# and says where. Constraints and indexes are not the code's business and are not checked.
#
#   scripts/check-migrations.sh              check this checkout against the previous release;
#                                            fails when RELEASES records none below HEAD
#   scripts/check-migrations.sh --self-test  the check against a scratch repository (a drop the
#                                            previous release reads fails, one it does not read
#                                            passes, no release recorded fails) and against a
#                                            clone of this one with a planted drop of a column
#                                            the previous release reads
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELEASES="$REPO_DIR/scripts/releases.sh"

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
  local repo="$1" tag commit failures=0 previous
  # The release before this checkout: a release recorded on HEAD itself is this one.
  previous="$("$RELEASES" previous "$repo")" || {
    echo "check-migrations: FAILED: no previous release to compare with"
    return 1
  }
  read -r tag commit <<<"$previous"
  # A migration the release shipped is applied in its databases, and refinery refuses to migrate
  # one whose applied migration differs from the file (a checksum of every byte, comments too).
  local changed
  changed="$(git -C "$repo" diff --name-only --diff-filter=MDR "$commit" -- sql/ | sort -V)"
  for m in $changed; do
    echo "check-migrations: $m differs from release $tag's: \`seckill migrate\` would refuse every"
    echo "    database that release migrated; restore it (git checkout ${commit:0:12} -- $m)"
    failures=$((failures + 1))
  done
  local added
  added="$(git -C "$repo" diff --name-only --diff-filter=A "$commit" -- sql/ | sort -V)"
  for m in $added; do
    [[ -f "$repo/$m" ]] || continue
    while read -r ident; do
      [[ -n "$ident" ]] || continue
      local readers
      readers="$(git -C "$repo" grep -n -w -i "$ident" "$commit" -- src 2>/dev/null |
        sed "s/^$commit:/$tag:/" | head -3 || true)"
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
  echo "check-migrations: migrations since $tag (${commit:0:12}, RELEASES) remove nothing" \
    "release $tag reads ($(wc -w <<<"$added") new)"
}

# commit_all REPO MESSAGE
commit_all() { git -C "$1" add -A && git -C "$1" commit -qm "$2"; }

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
  commit_all "$tmp" release
  # No release recorded: nothing to compare with is a failure, not a pass.
  if check "$tmp" >/dev/null 2>&1; then
    echo "check-migrations self-test: a repository without a recorded release passed"
    return 1
  fi
  echo "v1.0.0 $(git -C "$tmp" rev-parse HEAD) 2026-01-01 V1 v1 v1" >"$tmp/RELEASES"
  # Not read by the release: the contract is safe.
  echo 'ALTER TABLE activity_skus DROP COLUMN legacy_note;' >"$tmp/sql/V2__contract.sql"
  commit_all "$tmp" contract
  check "$tmp" >/dev/null || { echo "check-migrations self-test: a safe drop was refused"; return 1; }
  # Read by the release: the rolling deploy would break it.
  printf 'ALTER TABLE activity_skus\n  DROP COLUMN remaining_stock;\n' >"$tmp/sql/V3__drop.sql"
  commit_all "$tmp" drop
  if check "$tmp" >/dev/null; then
    echo "check-migrations self-test: a drop the previous release reads was let through"
    return 1
  fi
  rm "$tmp/sql/V3__drop.sql"
  # A released migration changed, if only in a comment.
  echo '-- a comment' >>"$tmp/sql/V1__init.sql"
  commit_all "$tmp" edit
  if check "$tmp" >/dev/null; then
    echo "check-migrations self-test: a released migration edited was let through"
    return 1
  fi
  git -C "$tmp" checkout -q HEAD~1 -- sql/V1__init.sql
  commit_all "$tmp" restore
  echo 'ALTER TABLE activity_skus RENAME TO skus;' >"$tmp/sql/V3__rename.sql"
  commit_all "$tmp" rename
  if check "$tmp" >/dev/null; then
    echo "check-migrations self-test: a rename of a table the previous release reads was let through"
    return 1
  fi
  # This repository as committed, with a planted migration dropping a column its previous
  # release reads (orders.expires_at: every release's cancel path reads it).
  git clone -q "$REPO_DIR" "$tmp/clone"
  git -C "$tmp/clone" config user.email t@example.invalid
  git -C "$tmp/clone" config user.name test
  echo 'ALTER TABLE orders DROP COLUMN expires_at;' >"$tmp/clone/sql/V999__planted_drop.sql"
  commit_all "$tmp/clone" planted
  local out
  if out="$(check "$tmp/clone")"; then
    echo "check-migrations self-test: the planted drop of orders.expires_at was let through:"
    echo "$out"
    return 1
  fi
  grep -q 'V999__planted_drop.sql removes `expires_at`' <<<"$out" || {
    echo "check-migrations self-test: the planted drop failed for another reason:"
    echo "$out"
    return 1
  }
  echo "check-migrations self-test: ok (a safe drop passes; a read column dropped, a read table" \
    "renamed, a released migration edited, no recorded release fail; this repository's planted drop is caught against" \
    "$(sed -n 's/.*which release \(v[^ ]*\) still reads.*/\1/p' <<<"$out" | head -1))"
}

if [[ "${1:-}" == --self-test ]]; then
  self_test
else
  check "$REPO_DIR"
fi
