//! The `nodedns` binary: parse the command line, load the configuration, run, exit.
//!
//! Exit codes: 0 after a clean shutdown, 64 (EX_USAGE) for a bad command line or configuration,
//! 1 for anything else that stops start-up (or a forwarding loop found at start).

use nodedns_agent::{app, cli, config, logging, top};
use std::process::ExitCode;

/// EX_USAGE from sysexits.h: the command line or the configuration is wrong.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    let cli = match cli::parse(std::env::args_os()) {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return if err.use_stderr() {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match cli.command {
        cli::Command::Run(args) => run(*args),
        cli::Command::Top(args) => top::run(&args),
    }
}

fn run(args: cli::RunArgs) -> ExitCode {
    let log = match logging::init(args.log_format.into(), &args.log_level) {
        Ok(log) => log,
        Err(err) => {
            eprintln!("nodedns: --log-level: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let config = match config::load(&args.config) {
        Ok(config) => config,
        Err(err) => {
            tracing::error!("{err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.check_config {
        print!("{}", app::summary(&config));
        return ExitCode::SUCCESS;
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("nodedns: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(app::run(args, config, log)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}
