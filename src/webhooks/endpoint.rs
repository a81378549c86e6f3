//! Where webhook calls may go. A tenant chooses the URL, and fairlane calls
//! it from inside the operator's network, so a URL must not lead to that
//! network: loopback, private, link-local (cloud metadata at
//! 169.254.169.254), carrier-grade NAT, multicast and reserved addresses,
//! in IPv4 and IPv6 (IPv4 inside IPv6 included), are refused unless the
//! operator lists them in `webhooks.allow_private`.
//!
//! [`EndpointPolicy`] checks a URL twice: when the tenant sets it
//! ([`EndpointPolicy::parse`], then [`EndpointPolicy::check_reachable`],
//! which resolves a host name), and on every call, because a name may
//! resolve elsewhere by then (DNS rebinding): the webhook client resolves
//! through [`super::client::CheckingResolver`], which refuses a name with
//! any forbidden address, and an address written in the URL, which the
//! client does not resolve, is checked before the call
//! ([`EndpointPolicy::check_call`]).
//! The client follows no redirects, so an answer cannot send it elsewhere.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use url::{Host, Url};

use crate::config::WebhookSettings;

/// Longest webhook URL, as given and as stored.
pub const MAX_URL_CHARS: usize = 2048;

/// A host name that takes longer than this to resolve is refused.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// IPv4 ranges a webhook may not reach, first match named.
const INTERNAL_V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this-network"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private"),
    (Ipv4Addr::new(100, 64, 0, 0), 10, "carrier-grade NAT"),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignment"),
    (Ipv4Addr::new(192, 0, 2, 0), 24, "documentation"),
    (Ipv4Addr::new(192, 88, 99, 0), 24, "6to4 relay"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking"),
    (Ipv4Addr::new(198, 51, 100, 0), 24, "documentation"),
    (Ipv4Addr::new(203, 0, 113, 0), 24, "documentation"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    // 255.255.255.255, the broadcast address, included.
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
];

/// IPv6 ranges a webhook may not reach, first match named. Ranges that
/// carry an IPv4 address to reach (mapped, NAT64, 6to4) are judged by
/// that address instead, in [`internal_v6`].
const INTERNAL_V6: &[(Ipv6Addr, u8, &str)] = &[
    (Ipv6Addr::UNSPECIFIED, 128, "unspecified"),
    (Ipv6Addr::LOCALHOST, 128, "loopback"),
    (Ipv6Addr::UNSPECIFIED, 96, "IPv4-compatible"),
    (
        Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0),
        48,
        "local NAT64",
    ),
    (
        Ipv6Addr::new(0x100, 0, 0, 0, 0, 0, 0, 0),
        64,
        "discard-only",
    ),
    (
        Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0),
        32,
        "documentation",
    ),
    // Teredo (2001::/32) and benchmarking (2001:2::/48) included.
    (
        Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0),
        23,
        "IETF protocol assignment",
    ),
    (
        Ipv6Addr::new(0x3fff, 0, 0, 0, 0, 0, 0, 0),
        20,
        "documentation",
    ),
    (
        Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0),
        7,
        "unique local",
    ),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10, "link-local"),
    (Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10, "site-local"),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8, "multicast"),
];

/// The kind of internal range `ip` is in (`"loopback"`, `"private"`, …),
/// or None for an address a webhook may reach.
pub fn internal_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let bits = u32::from(ip);
    INTERNAL_V4
        .iter()
        .find(|(net, prefix, _)| {
            let mask = u32::MAX << (32 - u32::from(*prefix));
            bits & mask == u32::from(*net)
        })
        .map(|(_, _, name)| *name)
}

fn internal_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let bits = u128::from(ip);
    // ::ffff:a.b.c.d (mapped), ::ffff:0:a.b.c.d (translated) and
    // 64:ff9b::a.b.c.d (NAT64) reach a.b.c.d; 2002:AABB:CCDD::/48 (6to4)
    // reaches A.B.C.D through a relay.
    let embedded = match bits >> 32 {
        0xffff | 0xffff_0000 => Some(bits as u32),
        0x0064_ff9b_0000_0000_0000_0000 => Some(bits as u32),
        _ if bits >> 112 == 0x2002 => Some((bits >> 80) as u32),
        _ => None,
    };
    if let Some(v4) = embedded {
        return internal_v4(Ipv4Addr::from(v4));
    }
    INTERNAL_V6
        .iter()
        .find(|(net, prefix, _)| {
            let mask = u128::MAX << (128 - u32::from(*prefix));
            bits & mask == u128::from(*net)
        })
        .map(|(_, _, name)| *name)
}

/// A webhook call refused because of where it would go.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The address, written in the URL or resolved from its host name, is
    /// internal and not in `webhooks.allow_private`.
    #[error("{addr} is a {range} address (not in webhooks.allow_private)")]
    NotAllowed { addr: IpAddr, range: &'static str },
    /// The host name did not resolve (in time).
    #[error("{host} does not resolve: {why}")]
    Unresolved { host: String, why: String },
}

/// What a tenant is told when [`EndpointPolicy::check_reachable`] refuses
/// `url`: not the address its host resolved to (the log has that).
pub fn refused_because(url: &Url) -> &'static str {
    match url.host() {
        Some(Host::Domain(_)) => {
            "must have a host name that resolves, and only to public addresses"
        }
        _ => "must not be a loopback, private, link-local or otherwise internal address",
    }
}

/// Which webhook URLs fairlane calls, from `[webhooks]`.
#[derive(Debug, Clone)]
pub struct EndpointPolicy {
    allow_http: bool,
    allow_private: Arc<[IpNet]>,
}

impl EndpointPolicy {
    pub fn new(settings: &WebhookSettings) -> Self {
        EndpointPolicy {
            allow_http: settings.allow_http,
            allow_private: settings.allow_private.clone().into(),
        }
    }

    /// Parses a URL as a tenant gives it into the form that is stored;
    /// Err says what is wrong with it. The host is not looked at here (see
    /// [`EndpointPolicy::check_reachable`]).
    pub fn parse(&self, given: &str) -> Result<Url, String> {
        // The URL parser drops tabs and line breaks without a word; a URL
        // with any control character is refused instead, so none reaches
        // the store or a log line looking like something else.
        if given.chars().any(char::is_control) {
            return Err("must not contain control characters (line breaks, tabs)".into());
        }
        let given = given.trim();
        if given.chars().count() > MAX_URL_CHARS {
            return Err(format!("must be at most {MAX_URL_CHARS} characters"));
        }
        let url = Url::parse(given).map_err(|err| format!("is not a URL: {err}"))?;
        self.check_form(&url)?;
        if url.as_str().chars().count() > MAX_URL_CHARS {
            return Err(format!(
                "must be at most {MAX_URL_CHARS} characters once normalised"
            ));
        }
        Ok(url)
    }

    /// The scheme, the host and no user info: checked when the URL is set
    /// and again before each call, as an endpoint may have been stored
    /// under other settings.
    fn check_form(&self, url: &Url) -> Result<(), String> {
        let scheme_ok = match url.scheme() {
            "https" => true,
            "http" => self.allow_http,
            _ => false,
        };
        if !scheme_ok {
            return Err(if self.allow_http {
                "must be an http or https URL".into()
            } else {
                "must be an https URL".into()
            });
        }
        if url.host().is_none() {
            return Err("must have a host".into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("must not contain a user name or password".into());
        }
        Ok(())
    }

    /// Ok when a webhook may reach `ip`.
    pub fn check_addr(&self, ip: IpAddr) -> Result<(), Refusal> {
        let Some(range) = internal_range(ip) else {
            return Ok(());
        };
        // `::ffff:10.1.2.3` is listed by listing 10.1.2.3.
        let canonical = ip.to_canonical();
        let listed = self
            .allow_private
            .iter()
            .any(|net| net.contains(&ip) || net.contains(&canonical));
        if listed {
            Ok(())
        } else {
            Err(Refusal::NotAllowed { addr: ip, range })
        }
    }

    /// Resolves `host` and checks every address it has: one forbidden
    /// address refuses the name, so a name cannot mix a public address
    /// with an internal one.
    pub async fn resolve(&self, host: &str) -> Result<Vec<SocketAddr>, Refusal> {
        let unresolved = |why: String| Refusal::Unresolved {
            host: host.to_owned(),
            why,
        };
        let addrs: Vec<SocketAddr> =
            tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, 0)))
                .await
                .map_err(|_| unresolved(format!("no answer within {RESOLVE_TIMEOUT:?}")))?
                .map_err(|err| unresolved(err.to_string()))?
                .collect();
        if addrs.is_empty() {
            return Err(unresolved("no addresses".into()));
        }
        for addr in &addrs {
            self.check_addr(addr.ip())?;
        }
        Ok(addrs)
    }

    /// Checks where a URL leads, when a tenant sets it: an address in the
    /// URL is checked, a host name resolved and each of its addresses
    /// checked.
    pub async fn check_reachable(&self, url: &Url) -> Result<(), Refusal> {
        match url.host() {
            Some(Host::Ipv4(ip)) => self.check_addr(IpAddr::V4(ip)),
            Some(Host::Ipv6(ip)) => self.check_addr(IpAddr::V6(ip)),
            Some(Host::Domain(name)) => self.resolve(name).await.map(|_| ()),
            None => Ok(()),
        }
    }

    /// Checks a stored URL before a call: its form, and an address written
    /// in it (the client resolves only names, through
    /// [`super::client::CheckingResolver`]). Err is the tenant's reason and
    /// the log's detail.
    pub fn check_call(&self, stored: &str) -> Result<Url, (&'static str, String)> {
        let url = Url::parse(stored).map_err(|err| {
            (
                "URL not allowed",
                format!("the stored URL does not parse: {err}"),
            )
        })?;
        self.check_form(&url)
            .map_err(|why| ("URL not allowed", format!("the URL {why}")))?;
        let literal = match url.host() {
            Some(Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
            Some(Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
            _ => None,
        };
        if let Some(ip) = literal {
            self.check_addr(ip)
                .map_err(|refusal| ("address not allowed", refusal.to_string()))?;
        }
        Ok(url)
    }
}

/// The [`Refusal`] among an error's causes, if any.
pub fn refusal_in<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Refusal> {
    std::iter::successors(Some(err), |err| err.source())
        .find_map(|err| err.downcast_ref::<Refusal>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow_http: bool, allow_private: &[&str]) -> EndpointPolicy {
        EndpointPolicy {
            allow_http,
            allow_private: allow_private
                .iter()
                .map(|net| net.parse().unwrap())
                .collect::<Vec<IpNet>>()
                .into(),
        }
    }

    fn range(ip: &str) -> Option<&'static str> {
        internal_range(ip.parse().unwrap())
    }

    #[test]
    fn internal_ipv4_addresses_are_named_and_public_ones_pass() {
        for (ip, kind) in [
            ("0.0.0.0", "this-network"),
            ("127.0.0.1", "loopback"),
            ("127.255.255.254", "loopback"),
            ("10.0.0.1", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "carrier-grade NAT"),
            ("100.127.255.255", "carrier-grade NAT"),
            ("192.0.0.8", "IETF protocol assignment"),
            ("192.0.2.1", "documentation"),
            ("198.51.100.1", "documentation"),
            ("203.0.113.1", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("240.0.0.1", "reserved"),
            ("255.255.255.255", "reserved"),
        ] {
            assert_eq!(range(ip), Some(kind), "{ip}");
        }
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.215.14",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.169.0.1",
            "223.255.255.255",
        ] {
            assert_eq!(range(ip), None, "{ip}");
        }
    }

    #[test]
    fn internal_ipv6_addresses_are_named_and_public_ones_pass() {
        for (ip, kind) in [
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("fc00::1", "unique local"),
            ("fd12:3456::1", "unique local"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation"),
            ("2001::1", "IETF protocol assignment"),
            ("100::1", "discard-only"),
            ("64:ff9b:1::1", "local NAT64"),
            ("::10.0.0.1", "IPv4-compatible"),
            ("::8.8.8.8", "IPv4-compatible"),
        ] {
            assert_eq!(range(ip), Some(kind), "{ip}");
        }
        for ip in [
            "2606:4700:4700::1111",
            "2001:4860:4860::8888",
            "2a00:1450::1",
        ] {
            assert_eq!(range(ip), None, "{ip}");
        }
    }

    #[test]
    fn ipv4_inside_ipv6_is_judged_by_the_ipv4_address() {
        for (ip, kind) in [
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:7f00:1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::ffff:0:127.0.0.1", "loopback"),
            ("64:ff9b::127.0.0.1", "loopback"),
            ("64:ff9b::a9fe:a9fe", "link-local"),
            ("2002:7f00:1::1", "loopback"),
            ("2002:a00:1::", "private"),
        ] {
            assert_eq!(range(ip), Some(kind), "{ip}");
        }
        for ip in ["::ffff:8.8.8.8", "64:ff9b::8.8.8.8", "2002:808:808::1"] {
            assert_eq!(range(ip), None, "{ip}");
        }
    }

    #[test]
    fn the_allow_list_admits_listed_internal_addresses_only() {
        let policy = policy(false, &["10.1.2.0/24", "127.0.0.1/32", "fd00:1::/64"]);
        for ip in [
            "10.1.2.3",
            "127.0.0.1",
            "::ffff:127.0.0.1",
            "fd00:1::5",
            "8.8.8.8",
        ] {
            assert!(policy.check_addr(ip.parse().unwrap()).is_ok(), "{ip}");
        }
        for ip in [
            "10.1.3.1",
            "127.0.0.2",
            "::1",
            "fd00:2::1",
            "169.254.169.254",
        ] {
            let refused = policy.check_addr(ip.parse().unwrap());
            assert!(
                matches!(refused, Err(Refusal::NotAllowed { .. })),
                "{ip}: {refused:?}"
            );
        }
    }

    #[test]
    fn a_url_must_be_https_without_user_info_or_control_characters() {
        let strict = policy(false, &[]);
        assert_eq!(
            strict
                .parse(" HTTPS://Example.COM:443/a b?x=1 ")
                .unwrap()
                .as_str(),
            "https://example.com/a%20b?x=1"
        );
        assert!(strict.parse("http://example.com/").is_err());
        assert!(strict.parse("ftp://example.com/").is_err());
        assert!(strict.parse("not a url").is_err());
        assert!(strict.parse("https://user:pass@example.com/").is_err());
        assert!(strict.parse("https://user@example.com/").is_err());
        assert!(strict.parse("https://:pass@example.com/").is_err());
        for bad in [
            "https://example.com/a\nb",
            "https://example.com/a\r\nX-Forged: 1",
            "https://exa\tmple.com/",
            "https://example.com/\u{7f}",
            "https://example.com/\u{85}",
        ] {
            let why = strict.parse(bad).unwrap_err();
            assert!(why.contains("control characters"), "{bad:?}: {why}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_CHARS));
        assert!(strict.parse(&long).is_err());
        assert!(policy(true, &[]).parse("http://example.com/").is_ok());
    }

    #[tokio::test]
    async fn an_address_in_the_url_is_checked_before_a_call_and_a_name_when_it_resolves() {
        let strict = policy(true, &[]);
        for url in [
            "http://127.0.0.1:9/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://0x7f.1/",
        ] {
            let (reason, _) = strict.check_call(url).unwrap_err();
            assert_eq!(reason, "address not allowed", "{url}");
            let parsed = Url::parse(url).unwrap();
            assert!(strict.check_reachable(&parsed).await.is_err(), "{url}");
        }
        let (reason, _) = policy(false, &[])
            .check_call("http://93.184.215.14/")
            .unwrap_err();
        assert_eq!(reason, "URL not allowed");
        assert!(strict.check_call("http://93.184.215.14/").is_ok());

        let refused = strict.resolve("localhost").await.unwrap_err();
        assert!(
            matches!(
                refused,
                Refusal::NotAllowed {
                    range: "loopback",
                    ..
                }
            ),
            "{refused:?}"
        );
        // Through the resolver's error type, as the client reports it.
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(refused);
        assert!(refusal_in(&*boxed).is_some());
    }
}
