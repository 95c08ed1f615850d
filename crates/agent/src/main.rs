//! The `nodedns` binary: parse the command line, raise the descriptor limit, load the
//! configuration, run, exit.
//!
//! Exit codes: 0 after a clean shutdown, 64 (EX_USAGE) for a bad command line or configuration,
//! 1 for anything else that stops start-up (or a forwarding loop found at start).

use nodedns_agent::{app, cli, logging, top};
use std::process::ExitCode;

/// EX_USAGE from sysexits.h: the command line or the configuration is wrong.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    one_malloc_arena();
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

/// Makes glibc's allocator keep one arena for every thread, unless `MALLOC_ARENA_MAX` says
/// otherwise. By default each thread that allocates gets an arena of its own, and the cache's
/// entries are allocated on whichever thread answers the miss, the UDP workers' or the runtime's:
/// entries evicted from one arena leave free memory there while new ones grow another, so the
/// process's peak RSS over a unique-name flood exceeded the cache's byte budget by the sum of
/// the arenas' high-water marks. With one arena the freed memory is reused (the shared harness:
/// 34-37 MB became 30 MB over 195k unique names at the defaults). Small allocations still come
/// from each thread's cache without a lock, and a cache hit allocates nothing.
#[allow(unsafe_code)]
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: called first in main, before any other thread exists; mallopt only sets a
        // tunable of the allocator.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}
