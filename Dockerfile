# The `seckill` image: one binary, every role selectable by its command (`api`, `consume`,
# `scan`, `timeout-cancel`, `migrate`, ...), migrations embedded, config under /etc/seckill,
# run as a non-root user. Multi-stage: the build stage compiles, the runtime stage carries the
# binary and the config only.
#
# Built as a shop builds it (public images):
#   podman build -t seckill .        (or docker build)
# On a machine that cannot pull them, `make image` (scripts/image.sh) builds this same file from
# bases made locally from Debian packages and the toolchain already on the machine, through the
# build arguments below.

# An image with cargo on its PATH, at least the Rust of `rust-version` in Cargo.toml.
ARG BUILD_IMAGE=docker.io/library/rust:1.95-bookworm
# A Debian bookworm with apt.
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
# The whole workspace: cargo loads every member's manifest (the bench and the RocketMQ servers'
# pin are members), the migrations are embedded from sql/ at compile time.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY sql ./sql
COPY bench ./bench
COPY tools ./tools
# Extra cargo flags: `--offline` when the registry is mounted instead of downloaded.
ARG CARGO_FLAGS=""
RUN cargo build --release --locked -p seckill ${CARGO_FLAGS} \
    && cp target/release/seckill /usr/local/bin/seckill

FROM ${RUNTIME_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin seckill \
    && mkdir -p /var/lib/seckill/archive && chown 10001 /var/lib/seckill/archive
COPY --from=build /usr/local/bin/seckill /usr/local/bin/seckill
COPY config /etc/seckill
ENV SECKILL_CONFIG_DIR=/etc/seckill \
    SECKILL_ENV=prod \
    SECKILL__RETENTION__ARCHIVE_DIR=/var/lib/seckill/archive
# What `seckill scan`'s retention archives before it deletes: mount a volume that outlives the
# container (docs/architecture/postgresql.md#the-archive).
VOLUME /var/lib/seckill/archive
USER 10001
ENTRYPOINT ["/usr/local/bin/seckill"]
CMD ["api"]
