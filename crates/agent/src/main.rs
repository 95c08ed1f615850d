//! The `nodedns` binary: parse the command line, raise the descriptor limit, load the
//! configuration, run, exit.
//!
//! Exit codes: 0 after a clean shutdown, 64 (EX_USAGE) for a bad command line or configuration,
//! 1 for anything else that stops start-up (or a forwarding loop found at start).

use nodedns_agent::{app, cli, logging, top};
use std::process::ExitCode;

/// jemalloc: why, in the workspace's Cargo.toml.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
    app::raise_descriptor_limit();
    let settings = match app::Settings::new(args) {
        Ok(settings) => settings,
        Err(err) => {
            tracing::error!("{err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if settings.check_only {
        print!("{}", app::summary(&settings));
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.threads)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("nodedns: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async {
        let app = app::App::build(settings, log).await?;
        app.serve().await
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // The error and its causes, one line.
            tracing::error!("{:#}", anyhow::Error::from(err));
            ExitCode::FAILURE
        }
    }
}
