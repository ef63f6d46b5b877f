//! `warren completions bash|zsh|fish`: the shell completion script, generated from the clap
//! definitions, on stdout.

use std::io::Write as _;

use anyhow::Context as _;
use clap::CommandFactory as _;
use clap_complete::Shell;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: CompletionShell,
}

/// The shells warren writes completions for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

impl From<CompletionShell> for Shell {
    fn from(shell: CompletionShell) -> Self {
        match shell {
            CompletionShell::Bash => Shell::Bash,
            CompletionShell::Zsh => Shell::Zsh,
            CompletionShell::Fish => Shell::Fish,
        }
    }
}

/// The completion script for `shell`.
pub fn script(shell: CompletionShell) -> Vec<u8> {
    let mut cmd = super::Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(Shell::from(shell), &mut cmd, "warren", &mut out);
    out
}

pub fn execute(args: &Args) -> anyhow::Result<i32> {
    let mut stdout = super::out::stdout();
    stdout
        .write_all(&script(args.shell))
        .and_then(|()| stdout.flush())
        .context("cannot write the completion script")?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shell_gets_a_script_naming_the_subcommands() {
        for shell in [
            CompletionShell::Bash,
            CompletionShell::Zsh,
            CompletionShell::Fish,
        ] {
            let text = String::from_utf8(script(shell)).expect("UTF-8");
            for sub in ["run", "declare", "publish", "dlq", "completions", "man"] {
                assert!(text.contains(sub), "{shell:?} script lacks {sub}");
            }
        }
    }
}
