//! AWS SDK configuration shared by the SES provider and the SQS backend:
//! the standard credential chain and region, unless the settings name a
//! region, an endpoint (a local SES/SQS-compatible server) or static
//! credentials for such a server.

use aws_config::{BehaviorVersion, ConfigLoader, Region};
use secrecy::{ExposeSecret, SecretString};

/// A loader for the shared SDK configuration; call `.load().await`.
pub fn loader(
    region: Option<&str>,
    endpoint_url: Option<&str>,
    access_key_id: Option<&str>,
    secret_access_key: Option<&SecretString>,
) -> ConfigLoader {
    let mut loader = aws_config::defaults(BehaviorVersion::latest());
    if let Some(region) = region {
        loader = loader.region(Region::new(region.to_owned()));
    }
    if let Some(endpoint_url) = endpoint_url {
        loader = loader.endpoint_url(endpoint_url);
    }
    if let (Some(key_id), Some(secret)) = (access_key_id, secret_access_key) {
        loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
            key_id,
            secret.expose_secret(),
            None,
            None,
            "fairlane-config",
        ));
    }
    loader
}

/// The SDK configuration for a provider's settings (region, endpoint and
/// static keys where set); fails naming `what` when no region is found.
pub async fn provider_config(
    settings: &crate::config::SesSettings,
    what: &str,
) -> anyhow::Result<aws_config::SdkConfig> {
    let sdk_config = loader(
        settings.region.as_deref(),
        settings.endpoint_url.as_deref(),
        settings.access_key_id.as_deref(),
        settings.secret_access_key.as_ref(),
    )
    .load()
    .await;
    if sdk_config.region().is_none() {
        anyhow::bail!("no AWS region for {what}: set providers.email.region or AWS_REGION");
    }
    Ok(sdk_config)
}
