//! The `warren` binary: parse the CLI, load the settings (exit 2 on a bad one), set up logs,
//! and hand over to the subcommand in `cli/`.

fn main() {
    let cli = warren::cli::Cli::parse_args();
    // `warren run`: SIGHUP, SIGUSR1 and SIGCONT are caught from here on (before the settings
    // load), kept and applied in order once the roles run; before this line they end it.
    if matches!(cli.command, warren::cli::Command::Run(_))
        && let Err(e) = warren::app::catch_operator_signals()
    {
        warren::cli::say(format_args!(
            "cannot catch SIGHUP, SIGUSR1 and SIGCONT: {e}"
        ));
        std::process::exit(1);
    }
    if let Some(code) = warren::cli::standalone(&cli) {
        std::process::exit(code);
    }
    let settings = match cli.settings() {
        Ok(s) => s,
        Err(e) => {
            warren::cli::say(format_args!("{e}"));
            std::process::exit(2);
        }
    };
    let logs = warren::cli::init_logs(&cli, &settings);
    // Built here so a failure is an error message, not a panic inside actix. One thread: the
    // actors, the database connections' sockets, lapin's tasks and the metrics exporter share
    // it, so a batch's insert answers on the thread that waits for it, and a socket event wakes
    // one thread, not a worker that wakes another (10% less CPU a message than two workers,
    // docs/performance.md, "What the measurements taught"). Parallel work has threads of its
    // own: lapin's I/O loop per connection, the API's actix-web workers, processors beyond the
    // first.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            warren::cli::say(format_args!("cannot start the async runtime: {e}"));
            std::process::exit(1);
        }
    };
    let system = actix::System::with_tokio_rt(move || runtime);
    let code = system.block_on(warren::cli::dispatch(cli, settings));
    // The queued log lines are written (1.1 s at the most) before the process ends.
    drop(logs);
    std::process::exit(code);
}
