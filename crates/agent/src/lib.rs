//! nodedns: a node-local DNS cache for Kubernetes — the agent, as a library the `nodedns`
//! binary (`main.rs`) and the fuzz targets (`crates/agent/fuzz`) build on.
//!
//! Map:
//! - [`cli`]: the command line (nodedns's flags and node-cache's, unchanged);
//! - [`config`]: the Corefile, node-cache's template variables, the kube-dns ConfigMap → [`config::Config`];
//! - [`host`]: the node's link, addresses and NOTRACK rules (crate `nodedns-hostnet`);
//! - [`handoff`]: zero-gap upgrades (the listening sockets handed to a new instance);
//! - [`serve`]: the UDP and TCP listeners and the request pipeline;
//! - [`admin`]: `/health`, `/ready`, `/metrics`, `/log-level`;
//! - [`metrics`]: what the request path counts, and the exposition of every metric;
//! - [`logging`]: text or JSON logs, the runtime filter, rate limits, the query log;
//! - [`top`]: `nodedns top`, a live view of a running agent's metrics;
//! - [`app`]: start-up and shutdown order.

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod handoff;
pub mod host;
pub mod logging;
pub mod metrics;
pub mod serve;
pub mod top;
