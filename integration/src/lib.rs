//! The harness for tests that need a real node: the `nodedns` binary run as a black box, a real
//! Knot (`knotd`) standing in for CoreDNS, a scripted upstream for faults Knot cannot produce,
//! real clients (`dig`, `kdig`, glibc via `getent`), and simulated nodes built from network
//! namespaces with real kernel rules.
//!
//! Nothing here is a mock of nodedns: tests talk to the agent only over the network, like a pod.

pub mod client;
pub mod knot;
pub mod netns;
pub mod node;
pub mod scripted;

use std::path::PathBuf;

/// The `nodedns` binary under test: `$NODEDNS_BIN`, or the one Cargo built next to this test
/// executable (`target/<profile>/nodedns`; `scripts/test` builds it before running the tests).
pub fn nodedns_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("NODEDNS_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/nodedns
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("nodedns"))
        .expect("target directory layout");
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build --bin nodedns`) or set NODEDNS_BIN",
        bin.display()
    );
    bin
}
