# Build stage: a release binary.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY config ./config
COPY migrations ./migrations
COPY openapi ./openapi
RUN cargo build --release --locked && cp target/release/fairlane /usr/local/bin/fairlane

# Run stage: the binary, CA certificates for AWS and SMS providers, and a
# volume for the SQLite file.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home /data fairlane && mkdir -p /data && chown fairlane /data
COPY --from=build /usr/local/bin/fairlane /usr/local/bin/fairlane
USER fairlane
WORKDIR /data
ENV FAIRLANE__SERVER__LISTEN=0.0.0.0:8080 \
    FAIRLANE__STORAGE__URL=sqlite:///data/fairlane.db
VOLUME /data
EXPOSE 8080
ENTRYPOINT ["fairlane"]
CMD ["serve"]
