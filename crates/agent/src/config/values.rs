//! Values that appear in Corefiles, flags and the kube-dns ConfigMap: domain names, reverse
//! zones written as CIDR, addresses with optional ports, Go durations. Each parser returns a
//! message (without location) that the caller places at its file and line.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// `name` in canonical form: ASCII lowercase, absolute (trailing dot), `.` for the root.
/// Rejects empty labels, labels over 63 bytes and names over 255 bytes in wire form
/// (RFC 1035 §2.3.4).
pub(crate) fn canonical_name(name: &str) -> Result<String, String> {
    if name.is_empty() || name == "." {
        return Ok(".".to_owned());
    }
    if !name.is_ascii() {
        return Err(format!(
            "`{name}` is not an ASCII domain name (write IDNs in punycode)"
        ));
    }
    let lower = name.to_ascii_lowercase();
    let relative = lower.strip_suffix('.').unwrap_or(&lower);
    let mut wire_len = 1;
    for label in relative.split('.') {
        if label.is_empty() {
            return Err(format!("`{name}` has an empty label"));
        }
        if label.len() > 63 {
            return Err(format!("`{name}` has a label longer than 63 bytes"));
        }
        if label
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err(format!(
                "`{name}` contains whitespace or control characters"
            ));
        }
        wire_len += 1 + label.len();
    }
    if wire_len > 255 {
        return Err(format!("`{name}` is longer than 255 bytes"));
    }
    Ok(format!("{relative}."))
}

/// Wire form (RFC 1035 §3.1) of a name already in canonical form.
pub(crate) fn wire(canonical: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(canonical.len() + 1);
    for label in canonical.split('.').filter(|l| !l.is_empty()) {
        // canonical_name bounds every label to 63 bytes.
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out
}

/// A zone written as a name or as a CIDR (`10.0.0.0/8` → `10.in-addr.arpa.`, as CoreDNS).
/// Only prefixes on label boundaries (multiples of 8 bits for IPv4, 4 for IPv6) are accepted:
/// other prefixes would expand into several zones.
pub(crate) fn zone(text: &str) -> Result<String, String> {
    match text.split_once('/') {
        Some((addr, bits)) => reverse_zone(text, addr, bits),
        None => canonical_name(text),
    }
}

fn reverse_zone(text: &str, addr: &str, bits: &str) -> Result<String, String> {
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| format!("`{text}`: `{addr}` is not an IP address"))?;
    let bits: u32 = bits
        .parse()
        .map_err(|_| format!("`{text}`: bad prefix length"))?;
    let (labels, step, max, suffix): (Vec<String>, u32, u32, &str) = match ip {
        IpAddr::V4(v4) => (
            v4.octets().iter().map(u8::to_string).collect(),
            8,
            32,
            "in-addr.arpa.",
        ),
        IpAddr::V6(v6) => (
            v6.octets()
                .iter()
                .flat_map(|b| [b >> 4, b & 0xf])
                .map(|n| format!("{n:x}"))
                .collect(),
            4,
            128,
            "ip6.arpa.",
        ),
    };
    if bits > max || bits % step != 0 {
        return Err(format!(
            "`{text}`: only prefixes on label boundaries are supported (a multiple of {step} \
             up to {max}); write the reverse zones it covers instead"
        ));
    }
    let kept = (bits / step) as usize;
    let mut zone: Vec<&str> = labels[..kept].iter().map(String::as_str).collect();
    zone.reverse();
    zone.push(suffix);
    Ok(zone.join("."))
}

/// Whether canonical `name` is `zone` or below it.
pub(crate) fn is_under(name: &str, zone: &str) -> bool {
    zone == "."
        || name == zone
        || (name.ends_with(zone) && name[..name.len() - zone.len()].ends_with('.'))
}

/// `IP`, `IP:PORT`, `[IPv6]` or `[IPv6]:PORT`; a missing port is `default_port`.
pub(crate) fn host_port(text: &str, default_port: u16) -> Result<SocketAddr, String> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        if let Ok(ip) = inner.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, default_port));
        }
    }
    Err(format!(
        "`{text}` is not an IP address with an optional port"
    ))
}

/// A listen address as CoreDNS's `health`, `ready` and `prometheus` take it: `HOST:PORT`, where
/// an empty HOST means every IPv4 address (`:8080` → `0.0.0.0:8080`) and `localhost` means
/// 127.0.0.1.
pub(crate) fn listen_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let bad = || format!("`{text}` is not HOST:PORT (such as `:8080` or `169.254.20.10:8080`)");
    let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let ip = match host {
        "" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        _ => host.parse().map_err(|_| bad())?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// A Go duration (`time.ParseDuration`), as CoreDNS options take them: `30s`, `1m30s`, `1.5h`,
/// `500ms`, `0`. Negative durations are refused.
pub(crate) fn go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("`{text}` is not a duration (such as `30s`, `5m`, `1h30m`)");
    let s = text.strip_prefix('+').unwrap_or(text);
    if s.starts_with('-') {
        return Err(format!("`{text}`: a duration cannot be negative"));
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(bad());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let number: f64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let nanos_per = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(bad()),
        };
        total += number * nanos_per;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Whole seconds of `d`, rounded up so that a sub-second setting is not silently zero.
pub(crate) fn ceil_secs(d: Duration) -> u32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    u32::try_from(secs).unwrap_or(u32::MAX)
}

/// A byte size: a plain number or one with a `K`, `M`, `G` (×1000) or `Ki`, `Mi`, `Gi` (×1024)
/// suffix, optionally followed by `B`.
pub(crate) fn byte_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix('B').unwrap_or(t);
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size in bytes"))?;
    let factor: u64 = match unit {
        "" => 1,
        "K" | "k" => 1000,
        "M" => 1000 * 1000,
        "G" => 1000 * 1000 * 1000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => {
            return Err(format!(
                "`{text}`: unknown unit `{unit}` (use K, M, G, Ki, Mi or Gi)"
            ));
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("`{text}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_lowercase_and_absolute() {
        assert_eq!(canonical_name("Cluster.Local").unwrap(), "cluster.local.");
        assert_eq!(canonical_name("cluster.local.").unwrap(), "cluster.local.");
        assert_eq!(canonical_name(".").unwrap(), ".");
        assert_eq!(canonical_name("").unwrap(), ".");
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(canonical_name("a..b").unwrap_err().contains("empty label"));
        assert!(canonical_name(&"a".repeat(64)).unwrap_err().contains("63"));
        let long = vec!["abcdefghij"; 25].join(".");
        assert!(canonical_name(&long).unwrap_err().contains("255"));
        assert!(
            canonical_name("bücher.de")
                .unwrap_err()
                .contains("punycode")
        );
    }

    #[test]
    fn wire_form_is_length_prefixed_labels() {
        assert_eq!(wire("."), [0]);
        assert_eq!(wire("ab.c."), [2, b'a', b'b', 1, b'c', 0]);
    }

    #[test]
    fn cidr_zones_become_reverse_zones() {
        assert_eq!(zone("10.0.0.0/8").unwrap(), "10.in-addr.arpa.");
        assert_eq!(zone("192.168.1.0/24").unwrap(), "1.168.192.in-addr.arpa.");
        assert_eq!(zone("fd00::/8").unwrap(), "d.f.ip6.arpa.");
        assert!(
            zone("10.0.0.0/12")
                .unwrap_err()
                .contains("label boundaries")
        );
        assert!(zone("nope/8").unwrap_err().contains("not an IP"));
    }

    #[test]
    fn is_under_respects_label_boundaries() {
        assert!(is_under("a.cluster.local.", "cluster.local."));
        assert!(is_under("cluster.local.", "cluster.local."));
        assert!(!is_under("xcluster.local.", "cluster.local."));
        assert!(is_under("anything.", "."));
    }

    #[test]
    fn host_port_defaults_the_port() {
        assert_eq!(
            host_port("10.0.0.1", 53).unwrap(),
            "10.0.0.1:53".parse().unwrap()
        );
        assert_eq!(
            host_port("10.0.0.1:5353", 53).unwrap(),
            "10.0.0.1:5353".parse().unwrap()
        );
        assert_eq!(
            host_port("fd00::1", 53).unwrap(),
            "[fd00::1]:53".parse().unwrap()
        );
        assert_eq!(
            host_port("[fd00::1]", 53).unwrap(),
            "[fd00::1]:53".parse().unwrap()
        );
        assert_eq!(
            host_port("[fd00::1]:54", 53).unwrap(),
            "[fd00::1]:54".parse().unwrap()
        );
        assert!(host_port("dns.google", 53).is_err());
        assert!(host_port("10.0.0.1:99999", 53).is_err());
    }

    #[test]
    fn listen_addresses_follow_coredns() {
        assert_eq!(
            listen_addr(":9253").unwrap(),
            "0.0.0.0:9253".parse().unwrap()
        );
        assert_eq!(
            listen_addr("localhost:9153").unwrap(),
            "127.0.0.1:9153".parse().unwrap()
        );
        assert_eq!(
            listen_addr("[::1]:8080").unwrap(),
            "[::1]:8080".parse().unwrap()
        );
        assert!(listen_addr("169.254.20.10").is_err());
        assert!(listen_addr(":http").is_err());
    }

    #[test]
    fn go_durations_parse_like_go() {
        assert_eq!(go_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(go_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(go_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(go_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(go_duration("0").unwrap(), Duration::ZERO);
        assert!(go_duration("30").is_err());
        assert!(go_duration("-1s").unwrap_err().contains("negative"));
        assert!(go_duration("1d").is_err());
        assert!(go_duration("").is_err());
        assert!(go_duration("s").is_err());
    }

    #[test]
    fn sizes_take_decimal_and_binary_units() {
        assert_eq!(byte_size("16Mi").unwrap(), 16 << 20);
        assert_eq!(byte_size("16MiB").unwrap(), 16 << 20);
        assert_eq!(byte_size("1000").unwrap(), 1000);
        assert_eq!(byte_size("2K").unwrap(), 2000);
        assert!(byte_size("12XB").is_err());
        assert!(byte_size("99999999999Gi").is_err());
    }

    #[test]
    fn ceil_secs_rounds_sub_seconds_up() {
        assert_eq!(ceil_secs(Duration::from_millis(500)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(5)), 5);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }
}
