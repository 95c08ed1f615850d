//! The startup capability check: one clear line instead of a later `EPERM` from netlink or
//! `bind`.

use crate::error::CapabilityError;

/// Capabilities the agent needs, with their bit numbers (`linux/capability.h`).
const NEEDED: [(&str, u32); 2] = [("CAP_NET_ADMIN", 12), ("CAP_NET_BIND_SERVICE", 10)];

/// Checks that the process holds CAP_NET_ADMIN (link, addresses, rules) and
/// CAP_NET_BIND_SERVICE (port 53) in its effective set, read from `/proc/self/status`.
pub fn check_capabilities() -> Result<(), CapabilityError> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(CapabilityError::Read)?;
    missing(&status)
}

/// The check on the text of a `/proc/<pid>/status` file.
pub(crate) fn missing(status: &str) -> Result<(), CapabilityError> {
    let cap_eff = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or(CapabilityError::Unparsable)?;
    let missing: Vec<&'static str> = NEEDED
        .iter()
        .filter(|(_, bit)| cap_eff & (1 << bit) == 0)
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CapabilityError::Missing { missing, cap_eff })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_with_full_capabilities_passes() {
        assert!(missing("Name:\tx\nCapEff:\t000001ffffffffff\n").is_ok());
    }

    #[test]
    fn each_missing_capability_is_named_on_one_line() {
        let err = missing("CapInh:\t0\nCapEff:\t0000000000000400\n").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("CAP_NET_ADMIN"), "{text}");
        assert!(!text.contains("CAP_NET_BIND_SERVICE"), "{text}");
        assert!(!text.contains('\n'));
        let err = missing("CapEff:\t0000000000000000\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("CAP_NET_ADMIN, CAP_NET_BIND_SERVICE")
        );
    }

    #[test]
    fn unreadable_status_is_an_error_not_a_panic() {
        for text in [
            "",
            "CapEff:",
            "CapEff:\tzz",
            "CapEff:\t1ffffffffffffffffffff",
        ] {
            assert!(matches!(missing(text), Err(CapabilityError::Unparsable)));
        }
    }
}
