//! nodedns: a node-local DNS cache for Kubernetes.

mod config;

fn main() {}
