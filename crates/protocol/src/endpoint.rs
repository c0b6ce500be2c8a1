//! Where a replica process is reached: a `host:port` [`Endpoint`], the host a
//! name (a pod's stable DNS name, a host in `/etc/hosts`) or an IP literal.
//!
//! Parsing is pure; resolving a name is the dialer's job (the replica's
//! mesh resolves its `--peers` with retries and a bound, the controller at
//! every connection attempt), so a name that resolves only once its pod is
//! up is fine.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

/// A `host:port` address: `10.0.0.7:7000`, `[::1]:7000` or
/// `replica-5-1.replica-5:7000`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    host: String,
    port: u16,
}

/// Why a string is not a `host:port` [`Endpoint`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a host:port address: {reason}")]
pub struct EndpointError {
    /// The string given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl Endpoint {
    /// An endpoint from a host (a name or an IP literal, without brackets)
    /// and a port.
    pub fn new(host: impl Into<String>, port: u16) -> Result<Self, EndpointError> {
        let host = host.into();
        let input = format!("{host}:{port}");
        check_host(&host).map_err(|reason| EndpointError { input, reason })?;
        Ok(Endpoint { host, port })
    }

    /// The host: a name or an IP literal (an IPv6 one without brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address, if the host is an IP literal (no lookup).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.host
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, self.port))
    }
}

/// A host name (RFC 1123 labels, `_` allowed as in DNS-SD names) or an IP
/// literal.
fn check_host(host: &str) -> Result<(), &'static str> {
    if host.is_empty() {
        return Err("the host is empty");
    }
    if host.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    if host.len() > 253 {
        return Err("the host name is longer than 253 characters");
    }
    let labels_ok = host.trim_end_matches('.').split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    });
    if labels_ok {
        Ok(())
    } else {
        Err("the host is neither an IP address nor a host name (letters, digits, '-' and '_' in dot-separated labels)")
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| EndpointError {
            input: s.to_string(),
            reason,
        };
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(addr.into());
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (host, port) = rest
                .split_once("]:")
                .ok_or_else(|| err("a bracketed IPv6 host needs ]:PORT after it"))?;
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(err("the bracketed host is not an IPv6 address"));
            }
            (host, port)
        } else {
            let (host, port) = s.rsplit_once(':').ok_or_else(|| err("no :PORT"))?;
            if host.contains(':') {
                return Err(err("an IPv6 host must be in brackets: [ADDR]:PORT"));
            }
            (host, port)
        };
        let port: u16 = port
            .parse()
            .map_err(|_| err("the port is not a number in 0..=65535"))?;
        check_host(host).map_err(err)?;
        Ok(Endpoint {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Endpoint {
            host: addr.ip().to_string(),
            port: addr.port(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses_parse_and_print_back() {
        for s in [
            "127.0.0.1:7000",
            "[::1]:7000",
            "replica-5-1.replica-5.lockstep.svc.cluster.local:7000",
            "localhost:1",
            "lockstep-h3-0:42",
        ] {
            let e: Endpoint = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        let e: Endpoint = "replica-5-1.replica-5:7000".parse().unwrap();
        assert_eq!((e.host(), e.port()), ("replica-5-1.replica-5", 7000));
        assert_eq!(e.socket_addr(), None);
        let e: Endpoint = "[::1]:9".parse().unwrap();
        assert_eq!(e.socket_addr(), Some("[::1]:9".parse().unwrap()));
        assert_eq!(Endpoint::from(e.socket_addr().unwrap()), e);
    }

    #[test]
    fn bad_addresses_are_refused_naming_the_input() {
        for (s, why) in [
            ("", "no :PORT"),
            ("host", "no :PORT"),
            ("host:", "the port"),
            ("host:70000", "the port"),
            (":7000", "the host is empty"),
            ("::1:7000", "in brackets"),
            ("[host]:7000", "not an IPv6"),
            ("a..b:7000", "neither"),
            ("-a:7000", "neither"),
            ("a b:7000", "neither"),
        ] {
            let e = s.parse::<Endpoint>().unwrap_err();
            assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
            assert!(e.reason.contains(why), "{s}: {e}");
        }
        assert!(Endpoint::new("", 1).is_err());
    }
}
