//! The command line: global flags (`--config`, `--set`), one file per subcommand, the one
//! writer to stdout ([`out`]: a closed pipe ends a subcommand quietly), and the dispatch that
//! turns a subcommand's result into an exit code.

pub mod completions;
pub mod config;
pub mod ctl;
pub mod declare;
pub mod dlq;
pub mod events;
pub mod man;
pub mod r#move;
pub mod out;
pub mod pipelines;
pub mod publish;
pub mod run;
pub mod status;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{ConfigError, Settings, Sources};

/// warren: RabbitMQ -> PostgreSQL through a supervised, batched pipeline.
#[derive(Debug, Parser)]
#[command(
    name = "warren",
    version,
    about,
    long_about = None,
    after_help = "Settings: `warren run --help` lists every environment variable, `warren config \
                  --origin` shows the effective values and where each comes from; \
                  docs/configuration.md has them all. Exit status: see `warren run --help`."
)]
pub struct Cli {
    /// A TOML file layered over the built-in defaults (`warren config` shows them); empty
    /// (`WARREN_CONFIG=` or `--config ""`) means no file.
    #[arg(long, global = true, value_name = "PATH", env = "WARREN_CONFIG",
          value_parser = clap::builder::ValueParser::os_string())]
    pub config: Option<std::ffi::OsString>,
    /// Whether `config` came from `WARREN_CONFIG` rather than `--config`: its errors say which.
    #[arg(skip)]
    pub config_from_env: bool,
    /// Override a setting, KEY=VALUE (repeatable); wins over the file and the environment.
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the pipeline roles (consumer, dlq, api) until SIGTERM or SIGINT.
    Run(run::Args),
    /// Declare the RabbitMQ topology and apply the database migrations, idempotently.
    Declare(declare::Args),
    /// Publish users (a load generator, or JSON lines), or JSON lines to any pipeline
    /// (`--pipeline NAME`), with publisher confirms.
    Publish(publish::Args),
    /// Print the effective configuration, passwords redacted.
    Config(config::Args),
    /// Live instances (from Redis) and queue depths (from the broker).
    Status(status::Args),
    /// Remote control of running instances through Redis: pause, resume, drain, scale, history.
    Ctl(ctl::Args),
    /// Inspect and replay the dead-letter queue and the parked messages.
    Dlq(dlq::Args),
    /// The lifecycle events of every instance (from Redis): the last ones, or --follow them.
    Events(events::Args),
    /// Move the messages of a queue to an exchange, each confirmed before its source copy is acked.
    ///
    /// Each message is republished as it is (body, properties and headers unchanged), mandatory
    /// and with publisher confirms, in windows of --in-flight messages; the source copies of a
    /// window are acked only once the broker confirmed every copy in it. A copy that is
    /// unroutable, refused or not confirmed within PUBLISH_TIMEOUT_MS stops the move: its window
    /// stays in the source, and the command exits 1. Killed midway, whatever was not acked stays
    /// in the source: a message can then be in both places, never in neither, so moving again is
    /// safe.
    ///
    /// The move ends when the source is empty, after --limit messages, or after as many messages
    /// as the source held when it started (so a destination that routes back into the source
    /// cannot loop), and exits 0. A first SIGINT or SIGTERM stops it after the current window
    /// (exit 130); a second one at once (the unacked window returns to the source).
    Move(r#move::Args),
    /// List the pipelines (queues, table, mapping), or test one on JSON lines: `pipelines test NAME [FILE]`.
    Pipelines(pipelines::Args),
    /// Print the shell completion script (bash, zsh, fish) to stdout.
    Completions(completions::Args),
    /// Print the man page (roff) to stdout: warren(1), or a subcommand's page.
    Man(man::Args),
}

/// What warren's exit codes mean, for `--help` and the man pages.
pub const EXIT_STATUS: &[(&str, &str)] = &[
    (
        "0",
        "success; for run, a complete drain after SIGTERM, SIGINT or `ctl drain`",
    ),
    (
        "1",
        "a failure: a server unreachable, a command that failed or was refused, `pipelines test` \
         with a refused line; for run, a shutdown whose SHUTDOWN_TIMEOUT_MS left messages in flight",
    ),
    (
        "2",
        "a bad setting, flag or configuration file (the message names it), an unknown WARREN_* \
         variable, a pipeline name the configuration does not have (`pipelines test`, `publish \
         --pipeline`; the closest name said), or a pipeline whose table does not fit its mapping",
    ),
    (
        "130",
        "a second SIGINT or SIGTERM during a shutdown (run), or `move` interrupted",
    ),
];

/// The long help of `run`: every setting's environment variable with its default, generated
/// from the shipped defaults file, then the exit codes.
fn run_long_help() -> String {
    let mut out = String::from(
        "ENVIRONMENT:\n  Every setting is read from its variable; WARREN_<NAME> wins over <NAME>, and a \
         WARREN_* variable that is no setting stops warren (exit 2). A --config file and --set \
         override as documented in docs/configuration.md.\n\n",
    );
    for (name, text) in crate::config::environment_help() {
        out.push_str(&format!("  {name}\n      {text}\n"));
    }
    out.push_str("\nEXIT STATUS:\n");
    for (code, text) in EXIT_STATUS {
        out.push_str(&format!("  {code:<5}{text}\n"));
    }
    out
}

/// The clap command of `warren`, with what the derive cannot hold: the generated ENVIRONMENT and
/// EXIT STATUS of `run --help`.
pub fn command() -> clap::Command {
    use clap::CommandFactory as _;
    Cli::command().mut_subcommand("run", |run| run.after_long_help(run_long_help()))
}

impl Cli {
    /// Parses the process's arguments (with [`command`]'s additions), exiting on a usage error.
    pub fn parse_args() -> Self {
        use clap::FromArgMatches as _;
        let matches = command()
            .try_get_matches()
            .unwrap_or_else(|e| exit_with(&e));
        let mut cli = Self::from_arg_matches(&matches).unwrap_or_else(|e| exit_with(&e));
        cli.config_from_env =
            matches.value_source("config") == Some(clap::parser::ValueSource::EnvVariable);
        cli
    }

    /// Where the settings come from (the file, the environment, `--set` and named flags).
    pub fn sources(&self) -> Result<Sources, ConfigError> {
        let mut sources = Sources::new(self.config_file()).with_set_flags(&self.set)?;
        if self.config_from_env {
            sources.file_named_by = crate::config::FileNamedBy::Env;
        }
        if let Command::Run(args) = &self.command
            && let Some(roles) = &args.roles
        {
            sources = sources.with_override("roles", roles.clone());
        }
        // `run --pipelines`: the budget is checked against the pipelines kept
        // (`run::select_pipelines`), not against every one of the file.
        if let Command::Run(args) = &self.command {
            sources.selecting = args.pipelines.is_some();
        }
        Ok(sources)
    }

    /// The `--config` / `WARREN_CONFIG` file; an empty value is none.
    pub fn config_file(&self) -> Option<PathBuf> {
        self.config
            .as_ref()
            .filter(|path| !path.is_empty())
            .map(PathBuf::from)
    }

    /// The settings: defaults < --config file < environment < --set and named flags.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        Settings::load(&self.sources()?)
    }
}

/// Runs the subcommands that need no settings (`completions`, `man`), so that a bad setting
/// in the environment cannot stop them; `None` for every other subcommand.
pub fn standalone(cli: &Cli) -> Option<i32> {
    let result = match &cli.command {
        Command::Completions(args) => completions::execute(args),
        Command::Man(args) => man::execute(args),
        _ => return None,
    };
    Some(exit_code(result))
}

/// How many log lines may wait for stderr; past it a line is dropped and counted. Each line's
/// fields from a message are capped (1 KiB, `text::shown`), so the queue holds a few MiB at
/// the most.
pub const LOG_QUEUE_LINES: usize = 4096;

/// Logs to stderr: readable text, or JSON with `LOG_FORMAT=json`. `RUST_LOG` sets the level;
/// without it `run` logs info and the other subcommands warnings and errors only (their answer
/// is on stdout; a log line there is noise). Colours only when stderr is a terminal and
/// `NO_COLOR` is unset or empty. Lines are written by a thread of their own through a queue of
/// [`LOG_QUEUE_LINES`] (tracing-appender, lossy): a reader that stops reading (a paused pager, a
/// stalled log shipper) fills the queue and the lines after it are dropped and counted, never
/// waited for; a line that cannot be written (a closed pipe, a full disk) is dropped and counted,
/// never a panic (see [`LossyStderr`]). Keep the guard until the process exits: dropping it
/// writes what is queued (waiting 1.1 s at the most).
pub fn init_logs(cli: &Cli, settings: &Settings) -> tracing_appender::non_blocking::WorkerGuard {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter(&cli.command)));
    // Whatever RUST_LOG says: the AMQP client's warning for a returned message prints the
    // whole message, body and headers, uncapped (review R40a F11: a 300 KB line for an API
    // request's body, personal data included). warren says what it does with a returned
    // publish in its own words.
    if let Ok(quiet) = QUIET_TARGET.parse() {
        filter = filter.add_directive(quiet);
    }
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let (queue, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("warren-logs")
        .finish(LossyStderr);
    let writer = CountedQueue {
        dropped: queue.error_counter(),
        counted: std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        queue,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colours(std::io::stderr().is_terminal(), no_color))
        .log_internal_errors(false)
        .with_writer(writer);
    let _ = if settings.log_format == crate::config::LogFormat::Json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
    guard
}

/// The log queue, whose dropped lines (a full queue) are counted in
/// `warren_log_lines_dropped_total` as they happen.
#[derive(Clone)]
struct CountedQueue {
    queue: tracing_appender::non_blocking::NonBlocking,
    dropped: tracing_appender::non_blocking::ErrorCounter,
    /// How many of `dropped` the metric has counted.
    counted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CountedQueue {
    type Writer = CountedQueue;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Write for CountedQueue {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.queue.write(buf);
        let dropped = self.dropped.dropped_lines();
        let counted = self
            .counted
            .swap(dropped, std::sync::atomic::Ordering::Relaxed);
        for _ in counted..dropped {
            crate::metrics::log_line_dropped();
        }
        written
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.queue.flush()
    }
}

/// A directive added to every log filter, `RUST_LOG`'s too (see [`init_logs`]).
const QUIET_TARGET: &str = "lapin::returned_messages=off";

/// The log filter when `RUST_LOG` is unset: info for the service (`run`), warnings and errors
/// for the one-shot subcommands.
fn default_filter(command: &Command) -> String {
    let level = if matches!(command, Command::Run(_)) {
        "info"
    } else {
        "warn"
    };
    format!("{level},lapin=off,actix_server=warn,tokio_postgres=warn,refinery_core=warn")
}

/// Whether log lines are coloured: only on a terminal, and never with `NO_COLOR`
/// (<https://no-color.org>).
fn colours(terminal: bool, no_color: bool) -> bool {
    terminal && !no_color
}

/// stderr for the log lines. A write that fails (EPIPE once the pipe's reader is gone: Rust
/// ignores SIGPIPE, so the write returns the error) drops the line and counts it
/// (`warren_log_lines_dropped_total`); it never reports the error back, because
/// tracing-subscriber would print it with `eprintln!`, which panics on the same closed pipe
/// and so kills whichever task was logging.
struct LossyStderr;

impl Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_all(buf).map(|()| buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        if std::io::stderr().lock().write_all(buf).is_err() {
            crate::metrics::log_line_dropped();
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// Ends the process over what clap answers instead of a parsed command line: `--help` and
/// `--version` on stdout (exit 0), a usage error on stderr (exit 2). clap's own `exit` ignores a
/// failed write, so `warren --help > /dev/full` would say nothing and exit 0; here a write
/// error is an error as any subcommand's (exit 1), and a reader that went away stays quiet
/// (exit 0, see [`out`]).
fn exit_with(e: &clap::Error) -> ! {
    if e.use_stderr() {
        e.exit();
    }
    let text = e.render();
    let written = if std::io::stdout().is_terminal() {
        out::write(format_args!("{}", text.ansi()))
    } else {
        out::write(format_args!("{text}"))
    };
    if let Err(err) = out::unless_closed(written) {
        say(format_args!("{:#}", anyhow::Error::from(err)));
        std::process::exit(1);
    }
    std::process::exit(e.exit_code())
}

/// A command line that clap accepts but that asks for something impossible (`ctl scale --min 9
/// --max 2`): a usage error, exit 2 as clap's own.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Prints `warren: MESSAGE` to stderr for the person at the terminal; a closed stderr loses
/// it rather than panicking as `eprintln!` would.
pub fn say(message: std::fmt::Arguments) {
    let _ = writeln!(std::io::stderr(), "warren: {message}");
}

/// The settings that name the built-in users pipeline's exchanges and queues: one given in a
/// file, the environment or `--set` makes its names the configuration's own.
const USERS_NAME_SETTINGS: [&str; 7] = [
    "main_exchange",
    "main_queue",
    "retry_exchange",
    "retry_queue",
    "retry_ttls_ms",
    "dlx_exchange",
    "dlq_queue",
];

/// What the configuration says of each pipeline: a file's entry names its queues; the built-in
/// users pipeline names its own only when one of [`USERS_NAME_SETTINGS`] is given (where the
/// settings come from, `sources`, unknown: as if given); otherwise its names are the built-in
/// defaults, which yield to those a live instance runs it on.
pub(crate) fn configured(
    settings: &Settings,
    sources: Option<&Sources>,
) -> Vec<crate::registry::record::Configured> {
    let origins = sources.and_then(|s| crate::config::origins(s).ok());
    settings
        .pipelines()
        .iter()
        .map(|p| crate::registry::record::Configured {
            pipeline: crate::registry::PipelineRecord::of(&p.name, p.table(), &p.names),
            explicit: !p.builtin
                || origins.as_ref().is_none_or(|o| {
                    USERS_NAME_SETTINGS
                        .iter()
                        .any(|k| o.get(k).is_some_and(|from| from != "default"))
                }),
        })
        .collect()
}

/// Runs the subcommand; returns the process exit code.
pub async fn dispatch(cli: Cli, settings: Settings) -> i32 {
    let sources = cli.sources();
    let configured = configured(&settings, sources.as_ref().ok());
    let result = match cli.command {
        Command::Run(args) => match sources {
            Ok(sources) => run::execute(settings, sources, args, run::signals()).await,
            Err(e) => Err(e.into()),
        },
        Command::Declare(args) => declare::execute(&settings, args).await,
        Command::Pipelines(args) => pipelines::execute(&settings, args).await,
        Command::Publish(args) => publish::execute(&settings, args).await,
        Command::Config(args) => sources
            .map_err(anyhow::Error::from)
            .and_then(|sources| config::execute(&settings, &sources, args)),
        Command::Status(args) => status::execute(&settings, &configured, args).await,
        Command::Ctl(args) => ctl::execute(&settings, args).await,
        Command::Dlq(args) => dlq::execute(&settings, &configured, args).await,
        Command::Events(args) => events::execute(&settings, args).await,
        Command::Move(args) => r#move::execute(&settings, args).await,
        Command::Completions(args) => completions::execute(&args),
        Command::Man(args) => man::execute(&args),
    };
    exit_code(result)
}

/// A subcommand's result as the process exit code; an error is printed first. A subcommand
/// stopped by a closed stdout (its reader went away, `| head -1`) exits 0, silently.
fn exit_code(result: anyhow::Result<i32>) -> i32 {
    match result {
        Ok(code) => code,
        Err(e) if out::is_closed(&e) => 0,
        Err(e) => {
            say(format_args!("{e:#}"));
            // A configuration that cannot work (a pipeline whose table does not fit) is a bad
            // setting, as one the loader refuses.
            if e.downcast_ref::<ConfigError>().is_some() || e.downcast_ref::<Usage>().is_some() {
                2
            } else {
                1
            }
        }
    }
}

/// `text` safe to print on a terminal: control characters (ESC, CR, BEL, the C1 controls, ...)
/// and the Unicode direction marks are shown escaped (`\u{1b}`), so a string read from Redis or
/// the broker cannot move the cursor, recolour, retitle or reorder what the operator sees.
pub fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let hostile = c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if hostile {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}
/// JSON text safe to print on a terminal: serde_json escapes the C0 controls but not DEL, the
/// C1 controls (U+0080 to U+009F, which some terminals obey) nor the direction marks; these
/// can only stand inside strings, where `\uXXXX` means the same character to any JSON reader.
pub fn json_terminal_safe(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        let hostile = matches!(c, '\u{7f}'..='\u{9f}' | '\u{200e}' | '\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if hostile {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_users_names_are_the_configurations_only_when_a_name_setting_is_given() {
        let explicit = |sources: &Sources| {
            let settings = Settings::load(sources).expect("valid settings");
            configured(&settings, Some(sources))[0].explicit
        };
        let plain = Sources {
            use_env: false,
            ..Sources::default()
        };
        assert!(!explicit(&plain), "the built-in defaults");
        assert!(!explicit(&plain.clone().with_override("prefetch", "7")));
        for key in USERS_NAME_SETTINGS {
            let value = if key == "retry_ttls_ms" {
                "1000"
            } else {
                "mine"
            };
            assert!(explicit(&plain.clone().with_override(key, value)), "{key}");
        }
        let settings = Settings::load(&plain).expect("valid settings");
        assert!(configured(&settings, None)[0].explicit, "origins unknown");
    }

    #[test]
    fn colours_need_a_terminal_and_no_no_color() {
        assert!(colours(true, false));
        assert!(!colours(true, true));
        assert!(!colours(false, false));
        assert!(!colours(false, true));
    }

    #[test]
    fn only_run_logs_info_by_default() {
        let filter =
            |args: &[&str]| default_filter(&Cli::try_parse_from(args).expect("arguments").command);
        assert!(filter(&["warren", "run"]).starts_with("info,"));
        for sub in ["status", "declare", "config", "publish"] {
            assert!(filter(&["warren", sub]).starts_with("warn,"), "{sub}");
        }
    }

    #[test]
    fn terminal_controls_are_escaped_and_the_rest_kept() {
        assert_eq!(terminal_safe("vm-1 ünïcode 名"), "vm-1 ünïcode 名");
        assert_eq!(
            terminal_safe("a\x1b[2J\x07\r\n\u{9b}b\u{202e}c"),
            "a\\u{1b}[2J\\u{7}\\u{d}\\u{a}\\u{9b}b\\u{202e}c"
        );
        // The line and paragraph separators break a line on some terminals.
        assert_eq!(terminal_safe("a\u{2028}b\u{2029}"), "a\\u{2028}b\\u{2029}");
        let json = serde_json::json!({"s": "a\u{1b}\u{9b}\u{7f}\u{202e}\u{2028}é"}).to_string();
        let shown = json_terminal_safe(&json);
        assert_eq!(shown, r#"{"s":"a\u001b\u009b\u007f\u202e\u2028é"}"#);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&shown).unwrap(),
            serde_json::from_str::<serde_json::Value>(&json).unwrap()
        );
    }
}
