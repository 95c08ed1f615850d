//! The command line: `nodedns run` (the agent), `nodedns top` (a live view of a running agent's
//! metrics), and node-cache's flat command line, which [`parse`] turns into `run`.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{config, host, logging, top};

#[derive(Debug, Parser)]
#[command(
    name = "nodedns",
    version,
    about = "A node-local DNS cache for Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent in the foreground.
    Run(Box<RunArgs>),
    /// Show a running agent's traffic, refreshing in the terminal (reads its /metrics).
    Top(top::Args),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: config::ConfigArgs,

    #[command(flatten)]
    pub host: host::HostArgs,

    /// Load and validate the configuration, print what would be served, and exit (0 if valid,
    /// 64 with every error otherwise). Changes nothing on the host.
    #[arg(long)]
    pub check_config: bool,

    /// UDP workers per listen address (default: one per CPU, at most 4). Each worker resolves
    /// its own misses and keeps upstream connections of its own.
    #[arg(long, env = "NODEDNS_THREADS")]
    pub threads: Option<usize>,

    /// How long to keep answering after shutdown begins (readiness is false and the ClusterIP
    /// rules are withdrawn first), so clients and kube-proxy move away before listeners close.
    #[arg(long, default_value = "1s", value_parser = config::go_duration)]
    pub drain: Duration,

    /// Open TCP client connections at most (default: 1024, or fewer when the descriptor limit
    /// leaves less beside what the agent keeps for itself).
    #[arg(long)]
    pub tcp_max_connections: Option<usize>,

    /// Close a TCP client connection after this long without a complete query.
    #[arg(long, default_value = "10s", value_parser = config::go_duration)]
    pub tcp_idle_timeout: Duration,

    /// Open TCP connections from one client address at most (0: no per-client limit), so one
    /// client cannot take every connection (default: 128, or an eighth of
    /// --tcp-max-connections when that is less).
    #[arg(long)]
    pub tcp_max_connections_per_client: Option<usize>,

    /// Abort a TCP client connection when a write of its answers makes no progress for this
    /// long (the client does not read them).
    #[arg(long, default_value = "5s", value_parser = config::go_duration)]
    pub tcp_write_timeout: Duration,

    /// UDP queries a second answered per client address (a burst of as many at once); beyond
    /// that as many again are answered TC=1 (the client asks again over TCP) and the rest
    /// dropped. 0: no limit. Loopback clients are not limited (see --udp-rate-limit-loopback).
    #[arg(long, value_name = "QPS", default_value_t = crate::serve::ratelimit::DEFAULT_RATE)]
    pub udp_rate_limit: u32,

    /// Limit loopback clients (127.0.0.0/8, ::1) by --udp-rate-limit too.
    #[arg(long)]
    pub udp_rate_limit_loopback: bool,

    /// Directory shared by every nodedns instance on the node (a hostPath). A new instance takes
    /// the listening sockets over from the running one through a Unix socket here, so an upgrade
    /// loses no query (docs/reliability.md). Without it, no hand-over.
    #[arg(long, value_name = "DIR", env = "NODEDNS_HANDOFF_DIR")]
    pub handoff_dir: Option<std::path::PathBuf>,

    /// With --handoff-dir: the last instance to exit writes its cache there (`cache.snapshot`),
    /// and an instance that starts with nobody to take over from loads it if it was written at
    /// most this long ago (0: no snapshot; the default is serve-stale's default window, beyond
    /// which little of a cache is still usable). A hand-over carries the cache without it.
    #[arg(
        long,
        default_value = "1h",
        value_name = "DURATION",
        value_parser = config::go_duration,
        env = "NODEDNS_CACHE_SNAPSHOT_MAX_AGE"
    )]
    pub cache_snapshot_max_age: Duration,

    /// With --handoff-dir: neither send the cache to the instance the listening sockets are
    /// handed to, nor read the one the instance handing them over sends (the sockets are
    /// handed over all the same).
    #[arg(long, env = "NODEDNS_NO_CACHE_HANDOVER")]
    pub no_cache_handover: bool,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "NODEDNS_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// Log filter (tracing `EnvFilter` syntax, e.g. `info` or `nodedns=debug`). Changeable while
    /// running: `PUT /log-level` on the admin port, SIGUSR1 (debug), SIGUSR2 (back to this).
    #[arg(long, default_value = "info", env = "NODEDNS_LOG")]
    pub log_level: String,

    /// Log the queries of every server block, as if each had the `log` directive.
    #[arg(long)]
    pub query_log: bool,

    /// Share of the queries of logged blocks that is written, in (0, 1]: 0.01 logs one in 100.
    #[arg(long, default_value_t = 1.0, value_name = "FRACTION", value_parser = sample_rate)]
    pub query_log_sample: f64,

    #[command(flatten)]
    pub clients: crate::clients::Args,

    /// Do not count on the request path (the metrics endpoint stays, with request counts at
    /// zero). For measuring what counting costs.
    #[arg(long, env = "NODEDNS_NO_METRICS")]
    pub no_metrics: bool,
}

fn sample_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("`{text}` is not a fraction in (0, 1]")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl From<LogFormat> for logging::Format {
    fn from(format: LogFormat) -> Self {
        match format {
            LogFormat::Text => logging::Format::Text,
            LogFormat::Json => logging::Format::Json,
        }
    }
}

/// Parses the command line. node-cache's DaemonSet runs the image with flat Go-style flags
/// (`-localip 169.254.20.10,10.0.0.10 -conf /etc/Corefile ...`) and no subcommand: those are
/// rewritten to `run` with nodedns's long flags, so the stock `args:` work unchanged.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli, clap::Error> {
    let mut args = config::normalize_args(args);
    let subcommand_given = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| !a.starts_with('-') || matches!(a, "-h" | "--help" | "-V" | "--version"));
    if !subcommand_given {
        args.insert(1.min(args.len()), OsString::from("run"));
    }
    Cli::try_parse_from(args)
}
