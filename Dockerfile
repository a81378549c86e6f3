# fairlane in a container: the book's "Running in a container"
# (docs/src/deployment/container.md).
#
#   docker build -t fairlane .
#   docker run -d --name fairlane -p 8080:8080 -v fairlane-data:/data fairlane
#   docker logs fairlane 2>&1 | grep admin_token     # the generated admin token
#
# Or `docker compose -f deploy/compose.yml up -d`.

# Build stage: a release binary.
FROM rust:1.95-bookworm AS build
WORKDIR /src

# The dependencies first, in a layer of their own: it is rebuilt only when
# Cargo.toml or Cargo.lock change, not on every change to fairlane's code.
# A stand-in lib.rs and main.rs make the package build; their artefacts are
# removed so the real sources below are always compiled.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked --bin fairlane \
    && rm -rf src target/release/fairlane target/release/deps/fairlane-* \
        target/release/deps/libfairlane-* target/release/.fingerprint/fairlane-*

# fairlane itself. default.toml is compiled in and the migrations are
# embedded by sqlx::migrate!, so the binary needs nothing else at run time.
COPY config ./config
COPY migrations ./migrations
COPY src ./src
RUN cargo build --release --locked --bin fairlane \
    && cp target/release/fairlane /usr/local/bin/fairlane

# Run stage: the binary, CA certificates for AWS and SMS providers, and a
# volume for the SQLite file.
FROM debian:bookworm-slim
# ca-certificates is left unpinned on purpose: bookworm replaces the old
# version in its archive, so a pin would break the build at the next update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /data fairlane \
    && mkdir -p /data \
    && chown 10001:10001 /data
COPY --from=build /usr/local/bin/fairlane /usr/local/bin/fairlane
# By number, so the runtime and orchestrators need no passwd lookup.
USER 10001:10001
WORKDIR /data
ENV FAIRLANE__SERVER__LISTEN=0.0.0.0:8080 \
    FAIRLANE__STORAGE__URL=sqlite:///data/fairlane.db
VOLUME /data
EXPOSE 8080
# SIGTERM starts a graceful shutdown (consumers.shutdown_grace_secs, 20 s by
# default): give `docker stop` more than that with --time (compose.yml does).
STOPSIGNAL SIGTERM
ENTRYPOINT ["fairlane"]
CMD ["serve"]
