//! `warren man [SUBCOMMAND]...`: the man page (roff), generated from the clap definitions, on
//! stdout: warren(1), or warren-run(1), warren-dlq-parked(1), ... for a subcommand.

use std::io::Write as _;

use anyhow::{Context as _, bail};
use clap::CommandFactory as _;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The subcommand whose page to print, for example `run` or `dlq parked` (none: warren(1)).
    #[arg(value_name = "SUBCOMMAND")]
    pub path: Vec<String>,
}

/// The roff text of the page of `path` (empty: the top-level page).
pub fn page(path: &[String]) -> anyhow::Result<Vec<u8>> {
    let mut cmd = super::Cli::command();
    // Building gives each subcommand its full name (`warren run`) and page title (warren-run).
    cmd.build();
    for name in path {
        let Some(sub) = cmd.find_subcommand(name).cloned() else {
            let known: Vec<&str> = cmd.get_subcommands().map(|s| s.get_name()).collect();
            bail!(
                "no subcommand {name:?} under `{}`; expected one of {}",
                cmd.get_bin_name().unwrap_or("warren"),
                known.join(", ")
            );
        };
        cmd = sub;
    }
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd)
        .source(format!("warren {}", env!("CARGO_PKG_VERSION")))
        .manual("warren manual")
        .render(&mut out)
        .context("cannot render the man page")?;
    Ok(out)
}

pub fn execute(args: &Args) -> anyhow::Result<i32> {
    let text = page(&args.path)?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&text)
        .and_then(|()| stdout.flush())
        .context("cannot write the man page to stdout")?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top_page_lists_the_subcommands_and_a_subcommand_has_its_own() {
        let top = String::from_utf8(page(&[]).expect("page")).expect("UTF-8");
        assert!(
            top.starts_with(".ie") || top.contains(".TH warren 1"),
            "{top}"
        );
        for sub in ["run", "declare", "completions", "man"] {
            assert!(top.contains(sub), "warren(1) lacks {sub}");
        }
        let run = String::from_utf8(page(&["run".into()]).expect("page")).expect("UTF-8");
        assert!(run.contains(".TH warren-run 1"), "{run}");
        assert!(run.contains("declare"), "{run}");
        let parked = page(&["dlq".into(), "parked".into()]).expect("page");
        assert!(String::from_utf8_lossy(&parked).contains("warren-dlq-parked"));
        let err = page(&["nope".into()]).expect_err("unknown subcommand");
        assert!(err.to_string().contains("expected one of"), "{err}");
    }
}
