//! nodedns: a node-local DNS cache for Kubernetes — the agent, as a library the `nodedns`
//! binary (`main.rs`) and the fuzz targets (`crates/agent/fuzz`) build on.
//!
//! Map (docs/architecture.md says what each module owns and must never know):
//! - [`cli`]: the command line (nodedns's flags and node-cache's, unchanged);
//! - [`config`]: the Corefile, node-cache's template variables, the kube-dns ConfigMap → [`config::Config`];
//! - [`plugin`]: the directives of a block's chain after the cache (`hosts`, `whoami`): each one's
//!   configuration, logic and metrics, in CoreDNS's plugin order;
//! - [`app`]: the agent's life: settings → build → serve → shutdown, reloads, the hand-over loop;
//! - [`serve`]: the UDP and TCP listeners, the request pipeline, the directives that act on it
//!   (`log`, `errors`, `loop`), and another instance on the same addresses (`sibling`);
//! - [`plugin`]: the directives behind the cache that answer or change queries (`template`,
//!   `rewrite`), each with its configuration, logic and metrics;
//! - [`metrics`]: counters the request path writes, and the exposition of every metric (it
//!   depends on no other module of the agent);
//! - [`logging`]: text or JSON logs, the runtime filter, rate limits;
//! - [`host`]: the node's link, addresses and NOTRACK rules (crate `nodedns-hostnet`);
//! - [`handoff`]: zero-gap upgrades (the listening sockets handed to a new instance);
//! - [`warm`]: the cache carried over: to a new instance at a hand-over, or through a snapshot
//!   file across a restart;
//! - [`admin`]: `/health`, `/ready`, `/metrics`, `/log-level`, each address serving its roles;
//! - [`clients`]: per-client figures of the heaviest clients and abuse signals, in fixed memory;
//! - [`dnstap`]: the `dnstap` directive's query/response stream to a Unix or TCP sink;
//! - [`top`]: `nodedns top`, a live view of a running agent's metrics;
//! - [`accept`]: what every listener does when an accept fails (back off, log once in a while).

pub mod accept;
pub mod admin;
pub mod app;
pub mod cli;
pub mod clients;
pub mod config;
pub mod dnstap;
pub mod handoff;
pub mod host;
pub mod logging;
pub mod metrics;
pub mod plugin;
pub mod serve;
pub mod top;
pub mod warm;
