//! `warren ctl`: remote control through Redis. `pause`, `resume`, `drain`, `scale` and `rate` are queued
//! for the chosen instances (signed for each one with CONTROL_SECRET when it is set), which
//! apply them and record the outcome; `history` lists outcomes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Subcommand;
use comfy_table::{Table, presets};

use crate::config::Settings;
use crate::registry::{
    self, CtlCommand, CtlOutcome, Keys, REFUSED_BAD_SIGNATURE, REFUSED_UNSIGNED, Redis, now_s, utc,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub action: Action,
}

/// Which instances a command goes to.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Target {
    /// Every live instance on this host.
    #[arg(long, value_name = "HOST")]
    pub host: Option<String>,
    /// Every live instance of the deployment (REDIS_PREFIX).
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Stop taking deliveries; what is in flight finishes.
    Pause(Target),
    /// Take deliveries again.
    Resume(Target),
    /// Finish what is in flight and exit 0, as on SIGTERM.
    Drain(Target),
    /// Change the number of processors live.
    Scale {
        /// Processors per pipeline (1 to 256).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
        processors: u16,
        #[command(flatten)]
        target: Target,
    },
    /// Change the messages per second each pipeline takes from its queue (0 = no limit).
    Rate {
        /// Messages per second (0 to 1000000; 0 turns the limit off).
        #[arg(value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
        per_s: u32,
        #[command(flatten)]
        target: Target,
    },
    /// Recorded outcomes of remote commands, newest first.
    History {
        /// How many entries.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

pub async fn execute(settings: &Settings, args: Args) -> anyhow::Result<i32> {
    let keys = Keys::new(&settings.redis_prefix);
    let mut redis = Redis::new(&settings.redis_url);
    if let Err(e) = Redis::connect(&settings.redis_url).await {
        bail!("{e}");
    }
    let (name, processors, rate, target) = match args.action {
        Action::History { limit, json } => return history(&mut redis, &keys, limit, json).await,
        Action::Pause(t) => ("pause", None, None, t),
        Action::Resume(t) => ("resume", None, None, t),
        Action::Drain(t) => ("drain", None, None, t),
        Action::Scale { processors, target } => ("scale", Some(processors as usize), None, target),
        Action::Rate { per_s, target } => ("rate", None, Some(per_s), target),
    };
    let Some(instances) = registry::instances(&mut redis, &keys).await else {
        bail!("lost the connection to Redis while listing instances");
    };
    let chosen: Vec<(String, u32)> = instances
        .iter()
        .filter(|i| target.all || i.get("host") == target.host.as_ref())
        .filter_map(|i| Some((i.get("host")?.clone(), i.get("pid")?.parse().ok()?)))
        .collect();
    if chosen.is_empty() {
        match &target.host {
            Some(h) => bail!("no live instance on host {h:?} (see `warren status`)"),
            None => bail!(
                "no live instance registered under REDIS_PREFIX {:?}",
                settings.redis_prefix
            ),
        }
    }
    let command = CtlCommand {
        id: uuid::Uuid::new_v4().to_string(),
        command: name.to_string(),
        processors,
        rate,
        issued_at: now_s(),
        by: format!("{}:{}", crate::hostname(), std::process::id()),
        target: None,
        signature: None,
    };
    for (host, pid) in &chosen {
        // One copy per instance: the signature covers the target, so it cannot be redirected.
        let target = format!("{host}:{pid}");
        let mut copy = command.clone();
        if settings.control_secret.is_empty() {
            copy.target = Some(target);
        } else {
            copy.sign(&settings.control_secret, &target)
                .map_err(anyhow::Error::msg)?;
        }
        let json = serde_json::to_string(&copy)?;
        let key = keys.commands(host, *pid);
        let mut pipe = redis::pipe();
        pipe.rpush(&key, &json).ignore().expire(&key, 60).ignore();
        if redis.pipe::<()>(&pipe).await.is_none() {
            bail!("lost the connection to Redis while sending the command");
        }
    }

    // Wait for every chosen instance to record its outcome.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut outcomes: BTreeMap<(String, u32), CtlOutcome> = BTreeMap::new();
    while outcomes.len() < chosen.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let recent: Vec<String> = redis
            .query(redis::cmd("LRANGE").arg(keys.history()).arg(0).arg(499))
            .await
            .unwrap_or_default();
        for raw in recent {
            if let Ok(o) = serde_json::from_str::<CtlOutcome>(&raw)
                && o.id == command.id
            {
                outcomes.insert((o.host.clone(), o.pid), o);
            }
        }
    }
    let mut all_ok = true;
    let (mut unsigned, mut bad_signature) = (false, false);
    for (host, pid) in &chosen {
        match outcomes.get(&(host.clone(), *pid)) {
            Some(o) if o.outcome == "executed" => println!("{host}:{pid}  {name}  executed"),
            Some(o) => {
                all_ok = false;
                let error = o.error.as_deref().unwrap_or("?");
                unsigned |= error.starts_with(REFUSED_UNSIGNED);
                bad_signature |= error.starts_with(REFUSED_BAD_SIGNATURE);
                println!("{host}:{pid}  {name}  failed: {error}");
            }
            None => {
                all_ok = false;
                println!("{host}:{pid}  {name}  no answer within 15 s (busy, or gone)");
            }
        }
    }
    if unsigned {
        eprintln!(
            "warren: refused: the instance requires signed commands and CONTROL_SECRET is not set here; \
             run `warren ctl` with the deployment's CONTROL_SECRET"
        );
    }
    if bad_signature {
        eprintln!(
            "warren: refused: the signature did not verify; CONTROL_SECRET here differs from the instance's"
        );
    }
    Ok(if all_ok { 0 } else { 1 })
}

async fn history(redis: &mut Redis, keys: &Keys, limit: usize, json: bool) -> anyhow::Result<i32> {
    if limit == 0 {
        bail!("--limit: expected at least 1");
    }
    let raw: Vec<String> = redis
        .query(
            redis::cmd("LRANGE")
                .arg(keys.history())
                .arg(0)
                .arg(limit as isize - 1),
        )
        .await
        .unwrap_or_default();
    if json {
        for line in raw {
            println!("{line}");
        }
        return Ok(0);
    }
    let mut table = Table::new();
    table
        .load_style(presets::NOTHING)
        .set_header(vec!["WHEN", "INSTANCE", "COMMAND", "OUTCOME", "DETAIL"]);
    for line in raw {
        let Ok(o) = serde_json::from_str::<CtlOutcome>(&line) else {
            continue;
        };
        let detail = match (&o.error, o.processors, o.rate) {
            (Some(e), _, _) => e.clone(),
            (None, Some(n), _) => format!("processors={n}"),
            (None, None, Some(n)) => format!("rate={n}/s"),
            _ => String::new(),
        };
        table.add_row(vec![
            utc(o.at),
            format!("{}:{}", o.host, o.pid),
            o.command,
            o.outcome,
            detail,
        ]);
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    println!("{}", table.trim_fmt());
    Ok(0)
}
