//! Drive the host plumbing by hand, without the DNS agent, e.g. in a network namespace:
//!
//! ```text
//! ip netns exec node target/debug/examples/hostnet setup --ip 169.254.20.10,10.96.0.10 --link-kind bridge
//! ip netns exec node target/debug/examples/hostnet run --ip 169.254.20.10 --interval 1s --backend nftables
//! ip netns exec node target/debug/examples/hostnet teardown --ip 169.254.20.10,10.96.0.10 --link-kind bridge
//! ```
//!
//! `setup` sets up and exits (everything stays); `run` sets up, reconciles every interval and,
//! on SIGTERM or Ctrl-C, withdraws the service-IP rules, waits `--drain`, and tears down;
//! `teardown` removes everything (it sets up first, which also adopts leftovers, then removes).

use std::net::IpAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use nodedns_hostnet::{Backend, Host, LinkKind, Metrics, Spec, error_chain};

#[derive(Debug, Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Local IPs, comma-separated.
    #[arg(long, value_delimiter = ',', global = true)]
    ip: Vec<IpAddr>,
    #[arg(long, default_value = "nodelocaldns", global = true)]
    link: String,
    #[arg(long, default_value = "dummy", global = true)]
    link_kind: LinkKind,
    #[arg(long, default_value = "auto", global = true)]
    backend: Backend,
    #[arg(long, global = true)]
    health_port: Option<u16>,
    #[arg(long, default_value_t = 53, global = true)]
    port: u16,
}

#[derive(Debug, Subcommand)]
enum Command {
    Setup,
    Run {
        /// Reconcile interval, in seconds (`1s`, `500ms` or a bare number of seconds).
        #[arg(long, default_value = "1s", value_parser = parse_duration)]
        interval: Duration,
        #[arg(long, default_value = "1s", value_parser = parse_duration)]
        drain: Duration,
    },
    Teardown,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("bad duration `{text}`");
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().map(Duration::from_millis).map_err(|_| bad());
    }
    let seconds = text.strip_suffix('s').unwrap_or(text);
    seconds
        .parse()
        .map(Duration::from_secs_f64)
        .map_err(|_| bad())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let spec = Spec {
        link_name: cli.link,
        link_kind: cli.link_kind,
        dns_port: cli.port,
        health_port: cli.health_port,
        backend: cli.backend,
        ..Spec::new(cli.ip)
    };
    let metrics = Metrics::default();
    let host = Host::setup(spec, &metrics)
        .await
        .map_err(|e| anyhow::anyhow!(error_chain(&e)))?;
    println!(
        "ready: rules in {}",
        host.ruleset()
            .map_or("(not managed)".to_owned(), |r| r.to_string())
    );
    match cli.command {
        Command::Setup => Ok(()),
        Command::Teardown => host
            .teardown()
            .await
            .map_err(|e| anyhow::anyhow!(error_chain(&e))),
        Command::Run { interval, drain } => {
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => match host.reconcile().await {
                        Ok(report) if report.repairs.is_empty() => {}
                        Ok(report) => println!("repaired: {:?}", report.repairs),
                        Err(e) => eprintln!("reconcile failed: {}", error_chain(&e)),
                    },
                    _ = terminate.recv() => break,
                    _ = tokio::signal::ctrl_c() => break,
                }
            }
            if let Err(e) = host.withdraw_service_ips().await {
                eprintln!("withdraw failed: {}", error_chain(&e));
            }
            println!("withdrawn");
            tokio::time::sleep(drain).await;
            host.teardown()
                .await
                .map_err(|e| anyhow::anyhow!(error_chain(&e)))?;
            println!("removed");
            Ok(())
        }
    }
}
