# Multi-stage build of the one `seckill` binary; the image runs as a non-root user.
# (No Docker engine runs on the development machines; this is for deployment.)
FROM rust:1.85-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY sql ./sql
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home seckill
COPY --from=build /src/target/release/seckill /usr/local/bin/seckill
COPY config /etc/seckill
ENV SECKILL_CONFIG_DIR=/etc/seckill
USER 10001
ENTRYPOINT ["/usr/local/bin/seckill"]
CMD ["api"]
