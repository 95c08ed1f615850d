//! Everything `nodedns run` is told, read and checked at once before anything starts: the
//! configuration (Corefile, node-cache's flags, the kube-dns ConfigMap) and the runtime settings
//! (threads, drain, TCP limits, the UDP rate limit, hand-over, counting, the query log). The app
//! gets this one value; nothing after it reads the command line.

use std::path::PathBuf;
use std::time::Duration;

use super::descriptors;
use crate::cli::RunArgs;
use crate::clients;
use crate::config::{self, Config, ConfigArgs, ConfigError, Problem};
use crate::host::HostArgs;
use crate::serve::{querylog, ratelimit, tcp};

/// UDP workers per listen address at most, by default (`--threads` sets any number). Each
/// worker resolves its own misses on a runtime of its own and keeps its own upstream
/// connections (idle ones for `expire`): four answer far more than a node's pods ask, and on a
/// node of many CPUs one worker per CPU would hold one connection per worker to CoreDNS.
pub const DEFAULT_THREADS: usize = 4;

/// A validated configuration and the runtime settings, as the app uses them.
#[derive(Debug)]
pub struct Settings {
    pub config: Config,
    /// Where the configuration comes from, read again on every reload.
    pub sources: ConfigArgs,
    pub host: HostArgs,
    /// `--check-config`: validate, print, change nothing.
    pub check_only: bool,
    /// UDP workers per listen address (each a thread with a runtime of its own), and the main
    /// runtime's worker threads (TCP, DoT, DoH, the admin endpoints, background work).
    pub threads: usize,
    /// How long to keep answering after shutdown begins: `--drain`, or the `health` block's
    /// `lameduck` when that is longer.
    pub drain: Duration,
    pub tcp: Tcp,
    /// The UDP listeners' limit per client address.
    pub udp_rate_limit: ratelimit::Settings,
    /// `--handoff-dir`: where instances on the node hand the listening sockets over.
    pub handoff_dir: Option<PathBuf>,
    /// `--cache-snapshot-max-age`: how old a cache snapshot in the hand-over directory may be
    /// to be loaded at a plain start (zero: none is written or read).
    pub cache_snapshot_max_age: Duration,
    /// The cache carried with the sockets at a hand-over, both ways (`--no-cache-handover`
    /// turns it off).
    pub cache_handover: bool,
    /// `--pidfile`: where the process ID is written once serving.
    pub pidfile: Option<PathBuf>,
    /// Count on the request path (`--no-metrics` turns it off).
    pub counting: bool,
    pub querylog: querylog::Settings,
    /// The per-client figures' settings, the cluster domain settled (`--cluster-domain`, else
    /// the one the configuration implies).
    pub clients: clients::Args,
    /// No Corefile: plain command-line mode (the metrics default to loopback).
    pub cli_mode: bool,
}

/// The TCP listeners' bounds.
#[derive(Debug, Clone, Copy)]
pub struct Tcp {
    /// Per connection.
    pub limits: tcp::Limits,
    /// Open client connections at most, in all and from one client address (0: no cap): the
    /// flags, or derived from the descriptor limit ([`descriptors::Caps::derive`]).
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    /// The soft descriptor limit the caps were derived from, and what the agent keeps of it for
    /// everything but client connections.
    pub descriptors: u64,
    pub reserve: usize,
}

impl Settings {
    /// Loads the configuration `args` names and settles every runtime setting. A refusal lists
    /// every problem, the configuration's and the runtime flags' together.
    pub fn new(args: RunArgs) -> Result<Settings, ConfigError> {
        let runtime = check(&args);
        match config::load(&args.config) {
            Ok(config) if runtime.is_empty() => Ok(Settings::with_config(args, config)),
            Ok(_) => Err(ConfigError::Invalid { problems: runtime }),
            Err(ConfigError::Invalid { mut problems }) => {
                problems.extend(runtime);
                Err(ConfigError::Invalid { problems })
            }
            Err(err) => Err(err),
        }
    }

    /// [`Settings::new`] with the configuration already loaded (the seam tests use).
    pub fn with_config(args: RunArgs, config: Config) -> Settings {
        let threads = args
            .threads
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| n.get().min(DEFAULT_THREADS))
            })
            .max(1);
        let drain = config
            .lameduck
            .map_or(args.drain, |lameduck| lameduck.max(args.drain));
        let cli_mode = args.config.conf.is_none() && args.config.basecorefile.is_none();
        let pidfile = args.config.pidfile.clone();
        let clients = clients::Args {
            cluster_domain: args
                .clients
                .cluster_domain
                .clone()
                .or_else(|| config.cluster_domain().map(str::to_owned)),
            ..args.clients.clone()
        };
        let descriptors = descriptors::soft_limit();
        let admin_addrs = crate::admin::addresses(&config, cli_mode).len();
        let reserve = descriptors::reserve(&config, threads, admin_addrs);
        let caps = descriptors::Caps::derive(
            descriptors,
            reserve,
            args.tcp_max_connections,
            args.tcp_max_connections_per_client,
        );
        Settings {
            config,
            sources: args.config,
            host: args.host,
            check_only: args.check_config,
            threads,
            drain,
            tcp: Tcp {
                limits: tcp::Limits {
                    idle_timeout: args.tcp_idle_timeout,
                    write_timeout: args.tcp_write_timeout,
                    ..tcp::Limits::default()
                },
                max_connections: caps.total,
                max_connections_per_client: caps.per_client,
                descriptors,
                reserve,
            },
            udp_rate_limit: ratelimit::Settings {
                rate: args.udp_rate_limit,
                loopback: args.udp_rate_limit_loopback,
            },
            handoff_dir: args.handoff_dir,
            cache_snapshot_max_age: args.cache_snapshot_max_age,
            cache_handover: !args.no_cache_handover,
            pidfile,
            counting: !args.no_metrics,
            querylog: querylog::Settings {
                all: args.query_log,
                sample: args.query_log_sample,
            },
            clients,
            cli_mode,
        }
    }
}

/// The runtime flags no agent can serve with.
fn check(args: &RunArgs) -> Vec<Problem> {
    let mut problems = Vec::new();
    if args.tcp_max_connections == Some(0) {
        problems.push(Problem::general(
            "--tcp-max-connections 0 would refuse every TCP client; give at least 1".to_owned(),
        ));
    }
    if args.tcp_idle_timeout.is_zero() {
        problems.push(Problem::general(
            "--tcp-idle-timeout 0s would close every TCP connection before its first query"
                .to_owned(),
        ));
    }
    if args.tcp_write_timeout.is_zero() {
        problems.push(Problem::general(
            "--tcp-write-timeout 0s would abort every TCP connection at its first answer"
                .to_owned(),
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let cli = crate::cli::parse(args.iter().map(Into::into)).unwrap();
        let crate::cli::Command::Run(args) = cli.command else {
            panic!("not run")
        };
        *args
    }

    fn settings(args: &[&str], config: Config) -> Settings {
        Settings::with_config(run_args(args), config)
    }

    #[test]
    fn runtime_flags_and_the_configuration_are_refused_together() {
        let dir = std::env::temp_dir().join(format!("nodedns-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let corefile = dir.join("Corefile");
        std::fs::write(&corefile, ".:53 {\n    frobnicate\n}\n").unwrap();
        let args = run_args(&[
            "nodedns",
            "run",
            "--conf",
            corefile.to_str().unwrap(),
            "--tcp-max-connections",
            "0",
            "--tcp-idle-timeout",
            "0s",
        ]);
        let err = Settings::new(args).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        let ConfigError::Invalid { problems } = &err else {
            panic!("{err}")
        };
        let text = err.to_string();
        assert_eq!(problems.len(), 3, "{text}");
        assert!(text.contains("frobnicate"), "{text}");
        assert!(text.contains("--tcp-max-connections 0"), "{text}");
        assert!(text.contains("--tcp-idle-timeout 0s"), "{text}");
    }

    #[test]
    fn the_thread_count_is_settled_once_and_never_zero() {
        let s = settings(&["nodedns", "run", "--threads", "3"], Config::default());
        assert_eq!(s.threads, 3);
        let s = settings(&["nodedns", "run", "--threads", "0"], Config::default());
        assert_eq!(s.threads, 1);
        let s = settings(&["nodedns", "run"], Config::default());
        assert!((1..=DEFAULT_THREADS).contains(&s.threads), "{}", s.threads);
        let s = settings(&["nodedns", "run", "--threads", "16"], Config::default());
        assert_eq!(s.threads, 16, "any number when asked");
    }

    #[test]
    fn the_drain_is_the_longer_of_the_flag_and_lameduck() {
        let s = settings(&["nodedns", "run", "--drain", "2s"], Config::default());
        assert_eq!(s.drain, Duration::from_secs(2));
        let lameduck = Config {
            lameduck: Some(Duration::from_secs(5)),
            ..Config::default()
        };
        let s = settings(&["nodedns", "run", "--drain", "2s"], lameduck.clone());
        assert_eq!(s.drain, Duration::from_secs(5));
        let s = settings(&["nodedns", "run", "--drain", "9s"], lameduck);
        assert_eq!(s.drain, Duration::from_secs(9));
    }

    #[test]
    fn runtime_flags_land_in_their_settings() {
        let s = settings(
            &[
                "nodedns",
                "run",
                "--no-metrics",
                "--query-log",
                "--query-log-sample",
                "0.5",
                "--tcp-idle-timeout",
                "3s",
                "--tcp-max-connections",
                "7",
            ],
            Config::default(),
        );
        assert!(!s.counting);
        assert_eq!(
            s.querylog,
            querylog::Settings {
                all: true,
                sample: 0.5
            }
        );
        assert_eq!(s.tcp.limits.idle_timeout, Duration::from_secs(3));
        assert_eq!(s.tcp.max_connections, 7);
        assert!(s.cli_mode);
        let s = settings(
            &[
                "nodedns",
                "-conf",
                "/etc/Corefile",
                "-localip",
                "169.254.20.10",
            ],
            Config::default(),
        );
        assert!(!s.cli_mode, "node-cache's command line names a Corefile");
    }

    #[test]
    fn the_cluster_domain_is_the_flag_else_the_configurations() {
        let config = Config {
            servers: vec![crate::config::Server {
                zones: vec!["cluster.local.".to_owned()],
                listen: Vec::new(),
                cache: None,
                forwards: Vec::new(),
                log: Vec::new(),
                errors: false,
                loop_check: false,
                dnstap: Vec::new(),
                chain: Default::default(),
                scheme: Default::default(),
                tls: None,
            }],
            ..Config::default()
        };
        let s = settings(&["nodedns", "run"], config.clone());
        assert_eq!(s.clients.cluster_domain.as_deref(), Some("cluster.local."));
        let s = settings(
            &["nodedns", "run", "--cluster-domain", "k8s.example"],
            config,
        );
        assert_eq!(s.clients.cluster_domain.as_deref(), Some("k8s.example."));
        let s = settings(&["nodedns", "run"], Config::default());
        assert_eq!(s.clients.cluster_domain, None);
    }
}
