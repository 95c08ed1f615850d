//! A real Knot DNS server (`knotd`, authoritative) standing in for CoreDNS.
//!
//! Contract (other tests code against it):
//!
//! ```ignore
//! pub struct Zone { pub origin: String, pub body: String }       // zone file text after $ORIGIN
//! pub struct Options { pub listen: Vec<SocketAddr>, pub netns: Option<String>, pub zones: Vec<Zone> }
//! pub struct Knot { .. }                                          // killed (by PID) on drop
//! impl Knot {
//!     pub fn start(options: Options) -> anyhow::Result<Knot>;     // returns once it answers
//!     pub fn cluster_local() -> Zone;                             // a standard cluster.local test zone
//!     pub fn queries(&self) -> anyhow::Result<u64>;               // queries it has received (mod-stats)
//!     pub fn tcp_queries(&self) -> anyhow::Result<u64>;
//!     pub fn stop(self);
//! }
//! ```
