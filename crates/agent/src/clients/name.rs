//! What a query name says about the client that asked it: long labels, random-looking labels
//! (the encodings DNS tunnels and exfiltration use), search-path expansions, and cheap hashes for
//! the sketches. Names are in wire form (RFC 1035 §3.1: length-prefixed labels, a zero at the
//! end) as the query carries them, in any case.

/// Labels shorter than this are not measured for randomness: a short label carries little data,
/// and its entropy is bounded by its length rather than by how it was made.
pub const RANDOM_MIN_LEN: usize = 20;

/// The labels of a wire-form name, stopping at the root or at the first malformed length.
pub fn labels(name: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let len = usize::from(*name.get(at)?);
        if len == 0 || len > 63 {
            return None;
        }
        let label = name.get(at + 1..at + 1 + len)?;
        at += 1 + len;
        Some(label)
    })
}

/// Whether the name has a label longer than `label_limit` bytes or is longer than `name_limit`
/// (in presentation form without the final dot: the wire length less two; RFC 1035 §2.3.4
/// allows 63 and 253).
///
/// Runs for every query: the name's length is known, and a label over the limit needs a name
/// longer than it, so the labels are walked only for long names.
#[inline]
pub fn is_long(name: &[u8], label_limit: usize, name_limit: usize) -> bool {
    let text_len = name.len().saturating_sub(2);
    if text_len > name_limit {
        return true;
    }
    if text_len <= label_limit {
        return false;
    }
    labels(name).any(|l| l.len() > label_limit)
}

/// Shannon entropy of a label's bytes, case folded, in bits per byte: −Σ p·log₂ p over the
/// distinct bytes (0 for an empty label).
pub fn entropy(label: &[u8]) -> f64 {
    let mut counts = [0u8; 256];
    for &b in label {
        let i = usize::from(b.to_ascii_lowercase());
        counts[i] = counts[i].saturating_add(1);
    }
    let n = label.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

/// Size of the smallest encoding alphabet holding every byte of the label, case folded: hex (16
/// symbols), base32 (`a`–`z`, `2`–`7`: 32), or anything else a host name may hold (letters,
/// digits, `-`, `_`: 38; base64, folded, lands here too).
fn alphabet(label: &[u8]) -> usize {
    let folded = || label.iter().map(u8::to_ascii_lowercase);
    if folded().all(|b| b.is_ascii_hexdigit()) {
        16
    } else if folded().all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b)) {
        32
    } else {
        38
    }
}

/// How random a label looks: its entropy over the entropy a uniformly random label of the same
/// length and alphabet is expected to have, log₂ A − (A − 1) / (2 L ln 2) for L bytes over A
/// symbols (the Miller–Madow bias of the empirical entropy). Random hex, base32 and base64
/// labels score about 1 (97 % or more of those of 32 bytes score at least 0.9); words joined by
/// hyphens score 0.75 to 0.87 (`kubernetes-dashboard-metrics-scraper` 0.85); a UUID 0.9.
/// `None` for labels shorter than [`RANDOM_MIN_LEN`].
pub fn randomness(label: &[u8]) -> Option<f64> {
    if label.len() < RANDOM_MIN_LEN {
        return None;
    }
    let a = alphabet(label) as f64;
    let expected = a.log2() - (a - 1.0) / (2.0 * label.len() as f64 * std::f64::consts::LN_2);
    Some(entropy(label) / expected)
}

/// Whether some label of the name scores at least `threshold` in [`randomness`].
pub fn is_random(name: &[u8], threshold: f64) -> bool {
    // A label of RANDOM_MIN_LEN needs a name at least that long (plus its length and the root).
    name.len() >= RANDOM_MIN_LEN + 2
        && labels(name).any(|l| randomness(l).is_some_and(|r| r >= threshold))
}

/// Whether `name` lies strictly under `domain` (both wire form, lowercase), ending at a label
/// boundary: `a.b.cluster.local.` is under `cluster.local.`, `xcluster.local.` is not. Nothing
/// is under the root (`domain` of one byte).
#[inline]
pub fn is_under(name: &[u8], domain: &[u8]) -> bool {
    if domain.len() <= 1 || name.len() <= domain.len() {
        return false;
    }
    let start = name.len() - domain.len();
    if !same(&name[start..], domain) {
        return false;
    }
    // The suffix must start where a label starts.
    let mut at = 0;
    while at < start {
        at += 1 + usize::from(name[at]);
    }
    at == start
}

/// `a == b` for slices of the same length, eight bytes at a time (the last word overlapping):
/// for a cluster domain's 15 bytes two compares, where a call to `bcmp` costs more than the
/// compare (it runs for every NXDOMAIN answer).
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a == b;
    }
    let word = |s: &[u8], at: usize| {
        s.get(at..at + 8)
            .and_then(|w| <[u8; 8]>::try_from(w).ok())
            .map(u64::from_ne_bytes)
    };
    let mut at = 0;
    while at + 8 < n {
        if word(a, at) != word(b, at) {
            return false;
        }
        at += 8;
    }
    word(a, n - 8) == word(b, n - 8)
}

/// The name without its first label: the zone a random-subdomain or tunnelling client keeps
/// asking under (`x1y2.t.example.com.` → `t.example.com.`). The root for a one-label name.
pub fn parent(name: &[u8]) -> &[u8] {
    match name.first() {
        Some(&len) if len > 0 => name.get(1 + usize::from(len)..).unwrap_or(&[0]),
        _ => &[0],
    }
}

/// A fast 64-bit hash of a name, case folded, mixed with a per-process seed. Not collision
/// resistant: a client that forces collisions only blurs its own figures.
pub fn hash(seed: u64, name: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = seed ^ (name.len() as u64).wrapping_mul(K);
    let mut chunks = name.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        // 0x20 folds ASCII letters to lower case (and leaves digits and '-' as they are).
        let w = u64::from_le_bytes(word) | 0x2020_2020_2020_2020;
        h = (h ^ w).wrapping_mul(K).rotate_left(29);
    }
    let mut tail = 0u64;
    for (i, &b) in chunks.remainder().iter().enumerate() {
        tail |= u64::from(b | 0x20) << (8 * i);
    }
    h = (h ^ tail).wrapping_mul(K);
    h ^ (h >> 32)
}

/// A wire-form name as text (`api.example.com.`), for labels and logs; bytes outside printable
/// ASCII as `\DDD` (RFC 1035 §5.1).
pub fn text(name: &[u8]) -> String {
    let mut out = String::with_capacity(name.len() + 1);
    for label in labels(name) {
        for &b in label {
            match b {
                b'.' | b'\\' | b'"' => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                0x21..=0x7e => out.push(char::from(b)),
                _ => out.push_str(&format!("\\{b:03}")),
            }
        }
        out.push('.');
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

/// A name in presentation form (`cluster.local`, `cluster.local.`) in wire form, lowercase;
/// `None` when a label is empty or too long.
pub fn wire(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('.');
    let mut out = Vec::with_capacity(text.len() + 2);
    if !text.is_empty() {
        for label in text.split('.') {
            let len = u8::try_from(label.len())
                .ok()
                .filter(|&l| (1..=63).contains(&l))?;
            out.push(len);
            out.extend(label.bytes().map(|b| b.to_ascii_lowercase()));
        }
    }
    out.push(0);
    (out.len() <= 255).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Vec<u8> {
        wire(text).unwrap()
    }

    /// A deterministic stream of pseudo-random bytes (xorshift64*).
    fn random_labels(alphabet: &[u8], len: usize, count: usize) -> Vec<Vec<u8>> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        (0..count)
            .map(|_| {
                (0..len)
                    .map(|_| {
                        state ^= state >> 12;
                        state ^= state << 25;
                        state ^= state >> 27;
                        let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33;
                        alphabet[(r % alphabet.len() as u64) as usize]
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn labels_walk_the_wire_form_and_stop_at_garbage() {
        let name = w("api.Example.com");
        let got: Vec<&[u8]> = labels(&name).collect();
        assert_eq!(got, [&b"api"[..], b"example", b"com"]);
        assert_eq!(labels(&[5, b'a']).count(), 0, "a length past the end");
        assert_eq!(labels(&[0]).count(), 0);
    }

    #[test]
    fn long_means_a_label_over_the_label_limit_or_a_name_over_the_name_limit() {
        let label51 = format!("{}.example.com", "a".repeat(51));
        let label50 = format!("{}.example.com", "a".repeat(50));
        assert!(is_long(&w(&label51), 50, 150));
        assert!(!is_long(&w(&label50), 50, 150));
        // 151 bytes of text in labels of 10.
        let long_name = vec!["abcdefghij"; 13].join(".") + ".abcdefg";
        assert_eq!(long_name.len(), 150);
        assert!(!is_long(&w(&long_name), 50, 150));
        assert!(is_long(&w(&(long_name + "x")), 50, 150));
        assert!(!is_long(
            &w("kube-dns.kube-system.svc.cluster.local"),
            50,
            150
        ));
    }

    #[test]
    fn entropy_is_bits_per_byte_case_folded() {
        assert_eq!(entropy(b""), 0.0);
        assert_eq!(entropy(b"aaaa"), 0.0);
        assert_eq!(entropy(b"abab"), 1.0);
        assert_eq!(entropy(b"ABab"), 1.0);
        assert_eq!(entropy(b"abcd"), 2.0);
        assert_eq!(entropy(b"0123456789abcdef"), 4.0);
    }

    #[test]
    fn random_hex_base32_and_base64_labels_score_high() {
        let hex = b"0123456789abcdef";
        let base32 = b"abcdefghijklmnopqrstuvwxyz234567";
        let base64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        for (what, alphabet) in [
            ("hex", &hex[..]),
            ("base32", &base32[..]),
            ("base64", &base64[..]),
        ] {
            for len in [32, 48, 63] {
                let flagged = random_labels(alphabet, len, 200)
                    .iter()
                    .filter(|l| randomness(l).unwrap() >= 0.9)
                    .count();
                assert!(
                    flagged >= 190,
                    "{what} of {len} bytes: only {flagged} of 200 score 0.9"
                );
            }
        }
    }

    #[test]
    fn ordinary_cluster_and_cloud_names_score_low() {
        for label in [
            "kube-state-metrics-monitoring",
            "kubernetes-dashboard-metrics-scraper",
            "elasticsearch-master-headless",
            "argocd-application-controller",
            "ingress-nginx-controller-admission",
            "login-microsoftonline-com",
            "prometheus-operator-kubelet",
            "observability-grafana-agent-operator",
        ] {
            let r = randomness(label.as_bytes()).unwrap();
            assert!(r < 0.9, "{label} scores {r}");
        }
        assert_eq!(randomness(b"short-label"), None);
        assert!(!is_random(&w("www.example.com"), 0.9));
        let exfil = w("mzxw6ytboi2dkmjzgm3tgnzygu2dmnjz.t.example.com");
        assert!(is_random(&exfil, 0.9));
    }

    #[test]
    fn under_means_below_the_domain_at_a_label_boundary() {
        let domain = w("cluster.local");
        assert!(is_under(
            &w("api.example.com.default.svc.cluster.local"),
            &domain
        ));
        assert!(is_under(&w("x.CLUSTER.Local"), &domain));
        assert!(!is_under(&w("cluster.local"), &domain), "the domain itself");
        assert!(!is_under(&w("xcluster.local"), &domain));
        assert!(is_under(
            &w("a.b.c.d.e.f.example.kubernetes.cluster.internal"),
            &w("example.kubernetes.cluster.internal")
        ));
        assert!(!is_under(
            &w("a.example.kubernetes.cluster.internax"),
            &w("example.kubernetes.cluster.internal")
        ));
        assert!(!is_under(
            &w("a.exbmple.kubernetes.cluster.internal"),
            &w("example.kubernetes.cluster.internal")
        ));
        assert!(is_under(&w("a.b.k8s"), &w("b.k8s")), "shorter than a word");
        // The domain's bytes inside one label, at the end of the name: not a boundary.
        assert!(!is_under(b"\x0fa\x07cluster\x05local\x00", &domain));
        assert!(!is_under(&w("example.com"), &domain));
        assert!(
            !is_under(&w("x.cluster.local"), &[0]),
            "the root is no domain"
        );
    }

    #[test]
    fn parent_drops_the_first_label() {
        assert_eq!(parent(&w("x1.t.example.com")), &w("t.example.com")[..]);
        assert_eq!(parent(&w("com")), &[0]);
        assert_eq!(parent(&[0]), &[0]);
    }

    #[test]
    fn hash_ignores_case_and_tells_names_apart() {
        let seed = 7;
        assert_eq!(
            hash(seed, &w("API.example.com")),
            hash(seed, &w("api.EXAMPLE.com"))
        );
        assert_ne!(
            hash(seed, &w("a.example.com")),
            hash(seed, &w("b.example.com"))
        );
        assert_ne!(hash(1, &w("a.example.com")), hash(2, &w("a.example.com")));
    }

    #[test]
    fn text_and_wire_round_trip() {
        assert_eq!(text(&w("Cluster.Local.")), "cluster.local.");
        assert_eq!(text(&[0]), ".");
        assert_eq!(text(&[3, b'a', b'.', 0xff, 0]), "a\\.\\255.");
        assert_eq!(wire("."), Some(vec![0]));
        assert_eq!(wire("a..b"), None);
    }
}
