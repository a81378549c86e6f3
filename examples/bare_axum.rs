//! The accept-path ceiling for `bench/accept.sh`: an axum server whose
//! `POST /v1/messages` only parses the JSON body and answers 202 with a
//! small JSON body, with no auth, validation, limits or storage. The accept
//! path's target is a share of what this answers on the same machine.
//!
//!     cargo run --release --example bare_axum -- 127.0.0.1:8099

use axum::Json;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

async fn accept(Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let channel = body.get("channel").cloned().unwrap_or(Value::Null);
    (
        StatusCode::ACCEPTED,
        Json(
            json!({"id": "00000000-0000-0000-0000-000000000000", "status": "queued", "channel": channel}),
        ),
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8099".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let app = axum::Router::new().route("/v1/messages", post(accept));
    axum::serve(listener, app).await?;
    Ok(())
}
