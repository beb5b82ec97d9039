#!/usr/bin/env bash
# Builds the `seckill` image from the repository's Dockerfile with podman (`make image`).
#
# Where the public base images can be pulled (SECKILL_IMAGE_BASES=public), the Dockerfile is
# built as it is. Where they cannot (this kind of machine has no registry but Debian's and
# crates.io; the default here, SECKILL_IMAGE_BASES=local), the same Dockerfile is built from
# bases made on the machine, through its build arguments:
#   - localhost/debian:bookworm   mmdebstrap --variant=minbase bookworm, imported (once);
#   - localhost/seckill-build     that base with a C toolchain from Debian (once per version
#                                 of deploy/image/build-base.Containerfile: its tag carries the
#                                 file's hash); cargo and rustc are the machine's own (rustup's
#                                 stable toolchain), mounted read-only into the build;
#   - the crates come from the machine's cargo registry, mounted, and the build runs
#     `cargo build --offline`: the COPY list alone must compile;
#   - the build's target directory is cached in ~/.cache/seckill/image-target.
#
# Environment: SECKILL_IMAGE (localhost/seckill:dev), SECKILL_IMAGE_BASES (local|public),
# SECKILL_IMAGE_CACHE (~/.cache/seckill/image).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${SECKILL_IMAGE:-localhost/seckill:dev}"
BASES="${SECKILL_IMAGE_BASES:-local}"
CACHE="${SECKILL_IMAGE_CACHE:-$HOME/.cache/seckill/image}"

log() { echo "image: $*"; }

. "$REPO_DIR/scripts/podman-lib.sh"

case "$BASES" in
  public)
    log "building $IMAGE from the public base images"
    podman_ build -t "$IMAGE" "$REPO_DIR"
    ;;
  local)
    mkdir -p "$CACHE" "$HOME/.cache/seckill/image-target"
    if ! podman_ image exists localhost/debian:bookworm; then
      log "making localhost/debian:bookworm from Debian packages (mmdebstrap, once)"
      command -v mmdebstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q mmdebstrap >/dev/null
      mmdebstrap --quiet --variant=minbase bookworm "$CACHE/bookworm.tar"
      podman_ import "$CACHE/bookworm.tar" localhost/debian:bookworm >/dev/null
      rm -f "$CACHE/bookworm.tar"
    fi
    # A changed build base (a tool added for a crate's build script) gets a new tag.
    build_base="localhost/seckill-build:bookworm-$(sha256sum "$REPO_DIR/deploy/image/build-base.Containerfile" | cut -c1-12)"
    if ! podman_ image exists "$build_base"; then
      log "making $build_base (a C toolchain for the build stage, once)"
      podman_ build --network host -t "$build_base" \
        -f "$REPO_DIR/deploy/image/build-base.Containerfile" "$REPO_DIR/deploy/image"
    fi
    # The toolchain this checkout builds with (rust-toolchain, rustup's default).
    toolchain="$(cd "$REPO_DIR" && rustc --print sysroot)"
    [[ -x "$toolchain/bin/cargo" ]] || { echo "image: no cargo in $toolchain/bin" >&2; exit 1; }
    log "building $IMAGE from the local bases with $("$toolchain/bin/rustc" --version)"
    podman_ build --network host -t "$IMAGE" \
      --build-arg BUILD_IMAGE="$build_base" \
      --build-arg RUNTIME_IMAGE=localhost/debian:bookworm \
      --build-arg CARGO_FLAGS=--offline \
      -v "$toolchain:/opt/rust:ro" \
      -v "$HOME/.cargo/registry:/usr/local/cargo/registry" \
      -v "$HOME/.cache/seckill/image-target:/src/target" \
      "$REPO_DIR"
    ;;
  *)
    echo "image: SECKILL_IMAGE_BASES must be local or public, not '$BASES'" >&2
    exit 2
    ;;
esac
log "built $IMAGE ($(podman_ image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
