//! The `warren` binary: parse the CLI, load the settings (exit 2 on a bad one), set up logs,
//! and hand over to the subcommand in `cli/`.

use clap::Parser;

fn main() {
    let cli = warren::cli::Cli::parse();
    if let Some(code) = warren::cli::standalone(&cli) {
        std::process::exit(code);
    }
    let settings = match cli.settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("warren: {e}");
            std::process::exit(2);
        }
    };
    warren::cli::init_logs(&settings);
    // Built here so a failure is an error message, not a panic inside actix.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warren: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let system = actix::System::with_tokio_rt(move || runtime);
    let code = system.block_on(warren::cli::dispatch(cli, settings));
    std::process::exit(code);
}
