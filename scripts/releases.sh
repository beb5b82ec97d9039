#!/usr/bin/env bash
# The release record (RELEASES at the repository's root, docs/RELEASING.md) read by the checks
# that compare this checkout with the release before it. Tags are not needed: a clone of main
# carries RELEASES and the commits it names, so every clone finds the same previous release.
#
#   scripts/releases.sh previous [REPO]  "<version> <commit>" of the newest recorded release
#                                        whose commit is below REPO's HEAD (an ancestor, not HEAD
#                                        itself); exit 1, saying why, when there is none
#   scripts/releases.sh commit VERSION   the commit RELEASES records for VERSION (exit 1 if none)
#   scripts/releases.sh check [REPO]     every record true of the commit it names (in this clone,
#                                        below HEAD, its Cargo.toml and Cargo.lock at the version,
#                                        its newest migration, the message schema its producers
#                                        write by default) and given a section in CHANGELOG.md
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The records of REPO's RELEASES, oldest first: version commit date schema writes reads.
records() {
  local file="$1/RELEASES"
  [[ -f "$file" ]] || return 0
  grep -vE '^[[:space:]]*(#|$)' "$file"
}

previous() {
  local repo="$1" version commit rest found=""
  [[ -f "$repo/RELEASES" ]] || {
    echo "releases: $repo has no RELEASES file: no release to compare with" >&2
    return 1
  }
  while read -r version commit rest; do
    git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null || {
      echo "releases: $version's commit $commit is not in this clone (a shallow clone? git fetch --unshallow)" >&2
      return 1
    }
    if [[ "$(git -C "$repo" rev-parse HEAD)" != "$commit" ]] &&
      git -C "$repo" merge-base --is-ancestor "$commit" HEAD; then
      found="$version $commit"
    fi
  done < <(records "$repo")
  [[ -n "$found" ]] || {
    echo "releases: no release recorded in RELEASES is below HEAD: nothing to compare with" >&2
    return 1
  }
  echo "$found"
}

# The ORDER_CREATE_REQUESTED version a release's producers write by default ("v1" when its
# default.toml names none: before the key existed).
written_schema() {
  local n
  n="$(git -C "$1" show "$2:config/default.toml" 2>/dev/null |
    sed -nE 's/^order_event_schema *= *([0-9]+).*/\1/p' | head -1)"
  echo "v${n:-1}"
}

check() {
  local repo="$1" failures=0 count=0 last="" version commit date schema writes reads extra
  note() {
    echo "releases: $version: $*"
    failures=$((failures + 1))
  }
  while read -r version commit date schema writes reads extra; do
    count=$((count + 1))
    if [[ -n "$extra" || -z "$reads" ]]; then note "a record has six fields"; continue; fi
    [[ "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || note "version is not v<major>.<minor>.<patch>"
    [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || note "commit is not 40 hex digits"
    [[ "$date" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}$ ]] || note "date is not YYYY-MM-DD"
    if [[ -n "$last" && "$(printf '%s\n%s\n' "$last" "$version" | sort -V | tail -1)" != "$version" ||
      "$last" == "$version" ]]; then
      note "not newer than $last (RELEASES lists the oldest first)"
    fi
    last="$version"
    if ! git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
      note "commit $commit is not in this clone"
      continue
    fi
    git -C "$repo" merge-base --is-ancestor "$commit" HEAD || note "commit $commit is not on HEAD's history"
    local v="${version#v}" newest
    git -C "$repo" show "$commit:Cargo.toml" | grep -qx "version = \"$v\"" ||
      note "Cargo.toml at ${commit:0:12} is not version $v"
    git -C "$repo" show "$commit:Cargo.lock" | grep -A1 -x 'name = "seckill"' | grep -qx "version = \"$v\"" ||
      note "Cargo.lock at ${commit:0:12} does not lock seckill $v (its --locked build fails)"
    newest="$(git -C "$repo" ls-tree --name-only "$commit" sql/ | sed -nE 's|^sql/(V[0-9]+)__.*|\1|p' | sort -V | tail -1)"
    [[ "$newest" == "$schema" ]] || note "schema $schema recorded, the commit's newest migration is $newest"
    [[ "$(written_schema "$repo" "$commit")" == "$writes" ]] ||
      note "writes $writes recorded, its default.toml writes $(written_schema "$repo" "$commit")"
    [[ ",$reads," == *",$writes,"* ]] || note "reads $reads but writes $writes"
    grep -qx "## \[$v\] - $date" "$repo/CHANGELOG.md" 2>/dev/null ||
      note "CHANGELOG.md has no section '## [$v] - $date'"
  done < <(records "$repo")
  ((count > 0)) || { echo "releases: RELEASES records no release"; return 1; }
  local head_version
  head_version="$(sed -nE 's/^version = "(.*)"/\1/p' "$repo/Cargo.toml" | head -1)"
  if [[ "$(printf '%s\n%s\n' "${last#v}" "$head_version" | sort -V | tail -1)" != "$head_version" ]]; then
    echo "releases: Cargo.toml's version $head_version is older than the last release $last"
    failures=$((failures + 1))
  fi
  ((failures == 0)) || return 1
  echo "releases: $count recorded, each true of its commit and in CHANGELOG.md (newest $last)"
}

case "${1:-}" in
  previous) previous "${2:-$REPO_DIR}" ;;
  commit)
    records "$REPO_DIR" | awk -v v="${2:?a version}" '$1 == v { print $2; found = 1 } END { exit !found }' ||
      { echo "releases: ${2} is not recorded in RELEASES" >&2; exit 1; }
    ;;
  check) check "${2:-$REPO_DIR}" ;;
  *)
    echo "usage: scripts/releases.sh previous|check [REPO] | commit VERSION" >&2
    exit 2
    ;;
esac
