//! The Go and miekg/dns parsing rules that CoreDNS's plugins inherit, shared by the directives
//! that read them: numbers as `strconv.ParseUint` reads them, RCODEs by miekg/dns's names.

/// Go's `strconv.ParseUint(text, base, bits)`; the error is Go's reason.
pub(crate) fn parse_uint(text: &str, base: u32, bits: u32) -> Result<u64, &'static str> {
    if text.is_empty() {
        return Err("invalid syntax");
    }
    let bits = match bits {
        0 => 64,
        1..=64 => bits,
        _ => return Err("invalid bit size"),
    };
    let lower = text.to_ascii_lowercase();
    // Base 0 reads the prefix and allows `_` between digits.
    let (base, digits) = match base {
        0 => {
            let (base, rest) = if let Some(rest) = lower.strip_prefix("0x") {
                (16, rest)
            } else if let Some(rest) = lower.strip_prefix("0o") {
                (8, rest)
            } else if let Some(rest) = lower.strip_prefix("0b") {
                (2, rest)
            } else if lower.len() > 1 && lower.starts_with('0') {
                (8, &lower[1..])
            } else {
                (10, lower.as_str())
            };
            if rest.starts_with('_') || rest.ends_with('_') || rest.contains("__") {
                return Err("invalid syntax");
            }
            (base, rest.replace('_', ""))
        }
        2..=36 => (base, lower),
        _ => return Err("invalid base"),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(base)) {
        return Err("invalid syntax");
    }
    let value = u64::from_str_radix(&digits, base).map_err(|_| "value out of range")?;
    if bits < 64 && value >> bits != 0 {
        return Err("value out of range");
    }
    Ok(value)
}

/// An RCODE by miekg/dns's name (`StringToRcode`, case as written): 0–10 and the extended
/// 16–23, which only a reply with EDNS can carry.
pub(crate) fn rcode(name: &str) -> Option<u16> {
    const NAMES: [&str; 11] = [
        "NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "YXDOMAIN", "YXRRSET",
        "NXRRSET", "NOTAUTH", "NOTZONE",
    ];
    // 16 is BADSIG (also BADVERS, a name miekg/dns does not map back).
    const EXTENDED: [&str; 8] = [
        "BADSIG",
        "BADKEY",
        "BADTIME",
        "BADMODE",
        "BADNAME",
        "BADALG",
        "BADTRUNC",
        "BADCOOKIE",
    ];
    if let Some(i) = NAMES.iter().position(|n| *n == name) {
        return Some(i as u16);
    }
    EXTENDED
        .iter()
        .position(|n| *n == name)
        .map(|i| 16 + i as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_uint_reads_prefixes_and_bounds_as_go() {
        assert_eq!(parse_uint("0xffee", 0, 16), Ok(0xffee));
        assert_eq!(parse_uint("010", 0, 16), Ok(8));
        assert_eq!(parse_uint("1_000", 0, 16), Ok(1000));
        assert_eq!(parse_uint("1_000", 10, 16), Err("invalid syntax"));
        assert_eq!(parse_uint("0x10000", 0, 16), Err("value out of range"));
        assert_eq!(parse_uint("ff", 16, 8), Ok(255));
        assert_eq!(parse_uint("gg", 16, 8), Err("invalid syntax"));
        assert_eq!(parse_uint("", 10, 8), Err("invalid syntax"));
        assert_eq!(parse_uint("1", 1, 8), Err("invalid base"));
    }

    #[test]
    fn rcodes_by_miekg_names() {
        assert_eq!(rcode("NXDOMAIN"), Some(3));
        assert_eq!(rcode("NOTZONE"), Some(10));
        assert_eq!(rcode("BADSIG"), Some(16));
        assert_eq!(rcode("BADCOOKIE"), Some(23));
        assert_eq!(rcode("nxdomain"), None);
        assert_eq!(rcode("BADVERS"), None);
    }
}
