//! `warren man [SUBCOMMAND]...`: the man page (roff), generated from the clap definitions, on
//! stdout: warren(1), or warren-run(1), warren-dlq-parked(1), ... for a subcommand. warren(1) and
//! warren-run(1) carry an ENVIRONMENT section generated from the shipped defaults (every setting's
//! variable, its meaning and default), and every page an EXIT STATUS section.

use std::io::Write as _;

use anyhow::{Context as _, bail};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The subcommand whose page to print, for example `run` or `dlq parked` (none: warren(1)).
    #[arg(value_name = "SUBCOMMAND")]
    pub path: Vec<String>,
}

/// The roff text of the page of `path` (empty: the top-level page).
pub fn page(path: &[String]) -> anyhow::Result<Vec<u8>> {
    let mut cmd = super::command();
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
    // The ENVIRONMENT and EXIT STATUS of `run --help` become sections of their own below.
    let environment = path.is_empty() || path == ["run"];
    let cmd = cmd.after_long_help(None::<&str>);
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd)
        .source(format!("warren {}", env!("CARGO_PKG_VERSION")))
        .manual("warren manual")
        .render(&mut out)
        .context("cannot render the man page")?;
    if environment {
        out.extend_from_slice(
            // Left-aligned: a long URL in a default cannot be justified without a warning.
            b".SH ENVIRONMENT\n.ad l\nEvery setting is read from its variable; WARREN_<NAME> wins over <NAME>, \
              and a WARREN_* variable that is no setting stops warren (exit 2).\n",
        );
        for (name, text) in crate::config::environment_help() {
            out.extend_from_slice(
                format!(".TP\n\\fB{}\\fR\n{}\n", roff(&name), roff(&text)).as_bytes(),
            );
        }
    }
    out.extend_from_slice(b".SH \"EXIT STATUS\"\n");
    for (code, text) in super::EXIT_STATUS {
        out.extend_from_slice(format!(".TP\n\\fB{code}\\fR\n{}\n", roff(text)).as_bytes());
    }
    Ok(out)
}

/// `text` as roff body text: backslashes escaped, a leading `.` or `'` kept literal.
fn roff(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with(['.', '\'']) {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

pub fn execute(args: &Args) -> anyhow::Result<i32> {
    let text = page(&args.path)?;
    let mut stdout = super::out::stdout();
    stdout
        .write_all(&text)
        .and_then(|()| stdout.flush())
        .context("cannot write the man page")?;
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
        assert!(run.contains(".SH ENVIRONMENT"), "{run}");
        assert!(
            run.contains("USERS_BATCH_SIZE (or WARREN_USERS_BATCH_SIZE)"),
            "{run}"
        );
        assert!(run.contains(".SH \"EXIT STATUS\""), "{run}");
        assert!(!run.contains(".SH EXTRA"), "{run}");
        assert!(!run.contains("guest:guest"), "defaults are redacted: {run}");
        assert!(run.contains("declare"), "{run}");
        let parked = page(&["dlq".into(), "parked".into()]).expect("page");
        assert!(String::from_utf8_lossy(&parked).contains("warren-dlq-parked"));
        let err = page(&["nope".into()]).expect_err("unknown subcommand");
        assert!(err.to_string().contains("expected one of"), "{err}");
    }
}
