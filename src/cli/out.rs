//! The CLI's one way to write to stdout: [`out!`] and [`outln!`] (a `print!` / `println!` that
//! returns its error), and [`stdout`] for code that takes a writer. A reader that went away
//! (`warren ... | head -1`: EPIPE, since Rust ignores SIGPIPE) is not a failure of warren's: the
//! error is marked [`Closed`] and [`super::dispatch`] ends the subcommand quietly with exit 0
//! ([`is_closed`]). Any other write error (a full disk under a redirect) is an error saying
//! `cannot write to stdout: ...`, exit 1. [`errln!`] is `eprintln!` without its panic. SIGPIPE is left ignored on purpose: the process also
//! writes to sockets, whose EPIPE must stay an error.

use std::io::{self, Write};

/// The reader of stdout closed it (EPIPE): what is left to print has nobody to read it.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct Closed;

/// A write to stdout failed for another reason than a closed reader (shown with its cause:
/// `cannot write to stdout: No space left on device`).
#[derive(Debug, thiserror::Error)]
#[error("cannot write to stdout")]
pub struct Failed(#[source] io::Error);

/// `e` (from writing to stdout) marked: [`Closed`] for a broken pipe, else [`Failed`], keeping
/// its kind.
fn mark(e: io::Error) -> io::Error {
    if e.get_ref()
        .is_some_and(|inner| inner.is::<Closed>() || inner.is::<Failed>())
    {
        e
    } else if e.kind() == io::ErrorKind::BrokenPipe {
        io::Error::new(io::ErrorKind::BrokenPipe, Closed)
    } else {
        io::Error::new(e.kind(), Failed(e))
    }
}

/// stdout, locked while this lives, whose errors are marked (see the module doc). Writes are
/// line-buffered as `println!`'s; call `flush` after text that does not end a line.
pub struct Stdout(io::StdoutLock<'static>);

/// stdout for code that takes a writer (`&mut impl Write`).
pub fn stdout() -> Stdout {
    Stdout(io::stdout().lock())
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(mark)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf).map_err(mark)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(mark)
    }
}

/// Writes `args` to stdout and flushes it: [`out!`]'s body.
pub fn write(args: std::fmt::Arguments) -> io::Result<()> {
    let mut out = stdout();
    out.write_fmt(args)?;
    out.flush()
}

/// Writes `args` and a newline to stdout and flushes it: [`outln!`]'s body.
pub fn line(args: std::fmt::Arguments) -> io::Result<()> {
    let mut out = stdout();
    out.write_fmt(args)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// `print!` that returns its error (marked, see the module doc) instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!($($arg)*))
    };
}

/// `println!` that returns its error (marked, see the module doc) instead of panicking.
macro_rules! outln {
    () => {
        $crate::cli::out::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::line(format_args!($($arg)*))
    };
}

/// `eprintln!` that loses the line on a closed stderr (`2>&-`, a log pipe gone) rather than
/// panicking: stderr carries notes beside the answer, never the answer.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub(crate) use {errln, out, outln};

/// `result` with a closed stdout taken as success: for a report printed before the outcome
/// that sets the exit code (a failed publish must still exit 1 when nobody reads its summary).
pub fn unless_closed(result: io::Result<()>) -> io::Result<()> {
    match result {
        Err(e) if is_closed_io(&e) => Ok(()),
        other => other,
    }
}

/// Whether `e` is a write to stdout whose reader had gone.
fn is_closed_io(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Closed>())
}

/// Whether a subcommand's error is, anywhere in its chain, a write to stdout whose reader had
/// gone: the subcommand stopped because nobody reads on, exit 0. A broken pipe on a socket is
/// not marked and stays an error.
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<Closed>() || cause.downcast_ref::<io::Error>().is_some_and(is_closed_io)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

    #[test]
    fn a_broken_pipe_is_closed_and_anything_else_names_stdout() {
        let closed = mark(io::Error::from(io::ErrorKind::BrokenPipe));
        assert_eq!(closed.kind(), io::ErrorKind::BrokenPipe);
        assert!(is_closed_io(&closed));
        let wrapped = anyhow::Error::from(closed).context("printing the table");
        assert!(is_closed(&wrapped));
        assert!(unless_closed(Err(mark(io::Error::from(io::ErrorKind::BrokenPipe)))).is_ok());

        let full = mark(io::Error::from_raw_os_error(28));
        assert!(!is_closed_io(&full));
        assert!(unless_closed(Err(mark(io::Error::from_raw_os_error(28)))).is_err());
        // Marked once: a second pass keeps the words, said once with the cause.
        let shown = format!("{:#}", anyhow::Error::from(mark(full)));
        assert_eq!(
            shown,
            format!(
                "cannot write to stdout: {}",
                io::Error::from_raw_os_error(28)
            )
        );
    }

    #[test]
    fn a_broken_pipe_elsewhere_is_an_error() {
        // A socket's EPIPE never went through `mark`: it is no closed stdout.
        let socket = anyhow::Error::from(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(!is_closed(&socket));
        let socket: anyhow::Result<()> = Err(io::Error::from(io::ErrorKind::BrokenPipe).into());
        assert!(!is_closed(&socket.context("writing to Redis").unwrap_err()));
    }
}
