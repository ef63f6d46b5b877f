//! What a stage a reload started asks of the stages this process's reloads stopped on its
//! queue before it: a redelivery of an ack one of them may have lost (`acked.rs`) is asked of
//! that stage's table (a DLQ stage's also of the parking under its name), and acked as done
//! when it was settled there ([`settled_before`]);
//! [`stored_of`] asks a table, also the stage's own about a statement that got no answer at a
//! stop (`sink.rs`).

use std::sync::Arc;

use deadpool_postgres::Pool;
use tracing::{info, warn};

use super::acked::AckPrint;
use super::copies::Copies;
use super::message::{Delivery, Failure};
use crate::amqp::headers;
use crate::db::{DbError, Statements, dead_letters};
use crate::domain::Domain;
use crate::metrics::{self, Stage, StageId};

pub use super::acked::PREDECESSORS;

/// A stage of the same kind on the same queue that a reload of this process stopped before it
/// started this one (another table, name or mapping, or only other settings): its domain, and
/// the name it parked under.
pub struct Predecessor<D: Domain> {
    pub domain: Arc<D>,
    pub parks_as: String,
    /// Its start (`acked::incarnation`): the acks it recorded are under it.
    pub incarnation: u64,
}

/// Of `deliveries`, those a stage this process's reloads stopped on the same queue settled
/// already, acked as done. The acks of a stopped stage's last commits may never have reached
/// the broker (its link silent at the close, or reset before it), which delivers those
/// messages again (redelivered), to whatever consumes the queue next. A redelivery whose print
/// is among the acks a predecessor left unproven (`acked.rs`, each used up once) is decoded
/// with that predecessor's mapping and asked of its table ([`Domain::settled`]: stored exactly,
/// or older than what its key holds); a DLQ stage's also of the parking under the
/// predecessor's name (it parked what its mapping or its table refused). Without it, a reload that changed the table, the name or
/// the mapping stored them in the new table too, or parked them `id_conflict` beside their rows
/// (review R40a F4, F6; R42b F1-F3 for a reset link, a second reload, a pipeline removed and
/// added back). Only those: asked of every redelivery, a message given back unsettled whose key
/// the old table held newer was acked as stale and never stored (review R44 F5). What cannot
/// be asked (the old table gone or locked, the database silent) goes on as any message.
pub(super) async fn settled_before<D: Domain>(
    config: &Asker<'_>,
    (copies, incarnation): (&Copies, u64),
    predecessors: &[Predecessor<D>],
    deliveries: &[Delivery],
    failures: &mut [Option<Failure>],
) -> Vec<Option<u64>> {
    let mut done: Vec<Option<u64>> = vec![None; deliveries.len()];
    let acked = copies.acked();
    if !acked.any_lost() {
        return done;
    }
    let asked: Vec<(usize, AckPrint)> = deliveries
        .iter()
        .enumerate()
        // Redelivered, or back from the retry queue after the old table was locked (a copy,
        // not a redelivery: `Failure::Waits`).
        .map(|(i, d)| (i, super::acked::print(&d.body, d.properties.bare())))
        .collect();
    if asked.is_empty() {
        return done;
    }
    let prints: std::collections::HashMap<usize, AckPrint> = asked.iter().copied().collect();
    let owners: Vec<u64> = predecessors
        .iter()
        .map(|b| b.incarnation)
        .chain([incarnation])
        .collect();
    // Its own lost acks' redeliveries are used up here: left, one would be taken for a later
    // message of the same print once a reload made this stage a predecessor.
    let found = acked.take_lost(&asked, &owners);
    for before in predecessors {
        let mine: Vec<usize> = found
            .iter()
            .filter(|(_, owner)| *owner == before.incarnation)
            .map(|&(i, _)| i)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let decoded: Vec<(usize, D::Record)> = mine
            .iter()
            .filter_map(|&i| {
                let d = &deliveries[i];
                let properties = d.properties.full();
                let envelope = d.envelope(&properties);
                before
                    .domain
                    .decode_with(&d.body, &envelope)
                    .ok()
                    .map(|r| (i, r))
            })
            .collect();
        let group: Vec<(usize, &D::Record)> = decoded.iter().map(|(i, r)| (*i, r)).collect();
        let settled = match asked_of_table(config, before, &group).await {
            Ok(settled) => settled,
            // The old table is locked (an operator's migration, a `LOCK TABLE`): these
            // redeliveries go through the retry queue uncounted (`Failure::Waits`), their acks
            // remembered again, and are asked again when they come back; the rest of the batch
            // goes on (review R44 F6: the question waited for the statement bound, and the live
            // pipeline behind it; R46a F7: given back to the head of the queue, they held it).
            // The old table is locked (an operator's migration, a `LOCK TABLE`), or the
            // question got no answer (no connection, a silent link): these redeliveries go
            // through the retry queue uncounted (`Failure::Waits`), their acks remembered
            // again, and are asked again when they come back; the rest of the batch goes on
            // (review R44 F6: the question waited for the statement bound, and the live
            // pipeline behind it; R46a F7: given back to the head of the queue, they held it;
            // R47a's rerun: a question with no answer went on, and 2 of 8,000 were stored or
            // parked twice).
            Err(e) if waits_on(&e) => {
                let indices: Vec<usize> = group.iter().map(|(i, _)| *i).collect();
                wait(
                    config,
                    before,
                    &e,
                    &indices,
                    (acked, &prints),
                    failures,
                    "table",
                );
                vec![false; group.len()]
            }
            Err(e) => {
                warn!(
                    pipeline = config.stage.pipeline(),
                    stage = config.stage.stage().as_str(),
                    before = %before.parks_as,
                    count = group.len(),
                    error = %e,
                    "cannot ask the table of a stage a reload replaced whether it settled \
                     these redeliveries; they go on as any message (one it had stored may be \
                     stored again)"
                );
                vec![false; group.len()]
            }
        };
        let mut ids = Vec::new();
        for ((i, _), yes) in group.iter().zip(settled) {
            if yes {
                done[*i] = Some(before.incarnation);
                ids.push(deliveries[*i].message_id());
            }
        }
        // A DLQ stage settles a message also by parking it: one its mapping refused (not
        // decoded above) or its table refused. Asked of the parking under its name, which may
        // be this stage's own (review R46a F10: a reload that kept the name and changed the
        // mapping to accept what the old one parked stored it too, and it was both stored and
        // parked; only other names were asked, when this stage was about to park).
        if config.stage.stage() == Stage::Dlq {
            let open: Vec<usize> = mine
                .iter()
                .copied()
                .filter(|i| {
                    done[*i].is_none() && !matches!(failures[*i], Some(Failure::Waits { .. }))
                })
                .collect();
            match parked_before(config, &before.parks_as, deliveries, &open).await {
                Ok(parked) => {
                    for i in parked {
                        done[i] = Some(before.incarnation);
                        ids.push(deliveries[i].message_id());
                    }
                }
                Err(e) if waits_on(&e) => {
                    wait(
                        config,
                        before,
                        &e,
                        &open,
                        (acked, &prints),
                        failures,
                        "parking",
                    );
                }
                Err(e) => warn!(
                    pipeline = config.stage.pipeline(),
                    stage = config.stage.stage().as_str(),
                    before = %before.parks_as,
                    count = open.len(),
                    error = %e,
                    "cannot ask the parking whether a stage a reload replaced parked these \
                     redeliveries; they go on as any message (one it had parked may be stored \
                     too)"
                ),
            }
        }
        if !ids.is_empty() {
            metrics::redeliveries(config.stage, "settled_before_reload", ids.len() as u64);
            info!(
                pipeline = config.stage.pipeline(),
                stage = config.stage.stage().as_str(),
                before = %before.parks_as,
                count = ids.len(),
                message_ids = ?ids.iter().take(10).collect::<Vec<_>>(),
                "redeliveries acked as done: a stage a reload replaced had settled them (their \
                 acks may have been lost with its link)"
            );
        }
    }
    done
}

/// The table question of [`settled_before`]: none when nothing decoded.
async fn asked_of_table<D: Domain>(
    config: &Asker<'_>,
    before: &Predecessor<D>,
    group: &[(usize, &D::Record)],
) -> Result<Vec<bool>, DbError> {
    if group.is_empty() {
        return Ok(Vec::new());
    }
    stored_of(config, before.domain.as_ref(), group).await
}

/// Of `open` (indices into `deliveries`), those parked under `name`, by the fingerprint the
/// router parks them with. What cannot be asked goes on as any message, with a warning.
async fn parked_before(
    config: &Asker<'_>,
    name: &str,
    deliveries: &[Delivery],
    open: &[usize],
) -> Result<Vec<usize>, DbError> {
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let prints: Vec<Vec<u8>> = open
        .iter()
        .map(|&i| {
            let d = &deliveries[i];
            let properties = d.properties.full();
            dead_letters::fingerprint(
                d.properties
                    .bare()
                    .message_id()
                    .as_ref()
                    .map(|m| m.as_str()),
                &d.body,
                &headers::parked_json(&properties, d.exchange.as_str(), d.routing_key.as_str()),
            )
        })
        .collect();
    config.statements.check_open()?;
    let parked = dead_letters::parked_of(
        config.pool,
        config.db_bound,
        config.statements,
        name,
        &prints,
    )
    .await?;
    Ok(open
        .iter()
        .zip(&prints)
        .filter(|(_, p)| parked.contains(*p))
        .map(|(i, _)| *i)
        .collect())
}

/// Whether a question to a predecessor's table or parking that failed with `e` is asked again
/// later rather than given up: the table locked, or no answer at all (no connection, a silent
/// link, past the bound). Not a dropped table, nor a stop (`NotStarted`).
fn waits_on(e: &DbError) -> bool {
    e.sqlstate() == Some(LOCK_NOT_AVAILABLE) || e.outcome_unknown()
}

/// The redeliveries at `indices`, whose question to `before`'s `what` (table or parking) failed
/// with `e`, wait: their acks remembered again under `before`, sent round uncounted
/// (`Failure::Waits`), counted as `waits_for_retired_table`, said in one warning.
fn wait<D: Domain>(
    config: &Asker<'_>,
    before: &Predecessor<D>,
    e: &DbError,
    indices: &[usize],
    (acked, prints): (
        &super::acked::Acked,
        &std::collections::HashMap<usize, AckPrint>,
    ),
    failures: &mut [Option<Failure>],
    what: &str,
) {
    let back: Vec<AckPrint> = indices
        .iter()
        .filter_map(|i| prints.get(i).copied())
        .collect();
    acked.give_back(before.incarnation, &back);
    metrics::redeliveries(config.stage, "waits_for_retired_table", back.len() as u64);
    warn!(
        pipeline = config.stage.pipeline(),
        stage = config.stage.stage().as_str(),
        before = %before.parks_as,
        count = indices.len(),
        error = %e,
        "the {what} of a stage a reload replaced is locked or did not answer: redeliveries \
         whose acks it may have lost go through the retry queue (a DLQ stage's back to the \
         DLQ), their retries not counted, to be asked again when they come back; the rest goes \
         on"
    );
    let reason: Arc<str> = format!(
        "the {what} of {}, which a reload replaced, was locked for over {} or did not answer: \
         asked again when the message comes back",
        before.parks_as, PREDECESSOR_LOCK_TIMEOUT
    )
    .into();
    for i in indices {
        failures[*i] = Some(Failure::Waits {
            reason: reason.clone(),
        });
    }
}

/// How long the question to a predecessor's table waits for a lock (an operator's migration
/// of the retired table, a `LOCK TABLE`): the live pipeline's batch waits behind it (review R44
/// F6: for the whole statement bound). Past it, the redeliveries go on as any message.
pub(super) const PREDECESSOR_LOCK_TIMEOUT: &str = "2s";

/// SQLSTATE `lock_not_available`: a `lock_timeout` passed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// What a question to a table needs of the stage that asks: its pool, its statements in
/// flight (its stop cancels them), the client's bound on one statement, its labels.
pub(super) struct Asker<'a> {
    pub pool: &'a Pool,
    pub statements: &'a Arc<Statements>,
    pub db_bound: std::time::Duration,
    pub stage: &'a StageId,
}

/// For each record of `group`, whether `domain`'s table already decides it
/// ([`Domain::settled`]: stored exactly, or, with versions, older than what its key holds),
/// asked on one connection within the statement bound; all `false` when it cannot tell.
pub(super) async fn stored_of<D: Domain>(
    config: &Asker<'_>,
    domain: &D,
    group: &[(usize, &D::Record)],
) -> Result<Vec<bool>, DbError> {
    // Once the stop cancelled the stage's statements none starts: said at once, not after
    // waiting for a connection (the stop waits for this answer).
    config.statements.check_open()?;
    let client = config.pool.get().await.map_err(DbError::from_pool)?;
    let running = config.statements.enter(&client)?;
    let records: Vec<&D::Record> = group.iter().map(|(_, r)| *r).collect();
    // Set for this question only; `reset` tells whether the connection is back as it came.
    let ask = async {
        let set = format!("SET lock_timeout = '{}'", PREDECESSOR_LOCK_TIMEOUT);
        if let Err(e) = client.batch_execute(&set).await {
            return (Err(DbError::from_pg(e)), true);
        }
        let answer = domain.settled(&client, &records).await;
        let reset = client.batch_execute("RESET lock_timeout").await.is_ok();
        (answer, reset)
    };
    let asked = tokio::time::timeout(config.db_bound, ask).await;
    drop(running);
    match asked {
        // The callers say what an error means for their deliveries (review R46a F2: a locked
        // table was said here as "they go on as any message", then by the caller as "they go
        // back to their queue").
        Ok((result, reset)) => {
            if reset {
                crate::db::release(config.pool, client, &result);
            } else {
                // Its lock_timeout would bind the next inserts on it.
                drop(deadpool_postgres::Object::take(client));
            }
            // An answer of other records than asked cannot be read.
            result.and_then(|s| match s.len() == group.len() {
                true => Ok(s),
                false => Err(DbError::Connection(format!(
                    "{} answers for {} records asked",
                    s.len(),
                    group.len()
                ))),
            })
        }
        Err(_) => {
            let _ = crate::db::abandon(client, config.db_bound);
            Err(DbError::Connection(format!(
                "no answer within {} ms",
                config.db_bound.as_millis()
            )))
        }
    }
}
