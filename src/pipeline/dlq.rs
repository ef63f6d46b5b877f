//! The DLQ consumer's fallback stage: what its sink could not insert is parked in
//! `dead_letters` (refused for good, or after `DLQ_MAX_ATTEMPTS` answers of a failing
//! database, counted in `x-dlq-attempts`), tried again later through the DLQ after a backoff,
//! or, while there is no database at all, given back to the DLQ after a backoff, uncounted.
//! Nothing loops in the DLQ forever and nothing is dropped.

use std::sync::Arc;

use actix::prelude::*;
use tracing::warn;

use super::message::{Disposition, Failure, Leftovers};
use super::router::{Fallback, Fate, Route};
use crate::amqp::headers::{self, Retries};
use crate::db::ErrorClass;
use crate::domain::ErrorKind;

/// The DLQ policy: where a message that failed this way goes, given the attempts the DLQ
/// consumer already spent on it (its `x-dlq-attempts`).
pub fn dlq_fate(failure: &Failure, attempts_so_far: &Retries, max_attempts: u32) -> Fate {
    match failure {
        Failure::Refused { kind, reason } => Fate::Park {
            kind: *kind,
            reason: reason.clone(),
        },
        // Asked again when it comes back to the DLQ, its attempts not counted.
        Failure::Waits { reason } => Fate::Route(Route::DlqAttempt {
            attempts: attempts_so_far.count(),
            reason: reason.to_string(),
            waits: true,
        }),
        Failure::Db { class, reason, .. } if *class == ErrorClass::Permanent => Fate::Park {
            kind: ErrorKind::DbPermanent,
            reason: reason.to_string(),
        },
        // The database answers with an error (a timeout too: the server's 57014, or work
        // past warren's bound while the database answers, `DbError::Outlasted`): count the
        // attempt, park after the bound.
        Failure::Db {
            class: ErrorClass::Transient,
            server_answered: true,
            reason,
        } => {
            if *attempts_so_far == Retries::Unreadable {
                // A count that would not grow is never cycled.
                return Fate::Park {
                    kind: ErrorKind::RetriesExhausted,
                    reason: format!(
                        "the DLQ consumer does not try again: its headers passed the parser's \
                         budget, so its x-dlq-attempts cannot be read: {reason}"
                    ),
                };
            }
            let attempts = attempts_so_far.count().saturating_add(1);
            if attempts >= max_attempts {
                Fate::Park {
                    kind: ErrorKind::RetriesExhausted,
                    reason: format!("the DLQ consumer gave up after {attempts} attempts: {reason}"),
                }
            } else {
                Fate::Route(Route::DlqAttempt {
                    attempts,
                    reason: reason.to_string(),
                    waits: false,
                })
            }
        }
        // No database at all (an outage): wait, count nothing.
        Failure::Db {
            class: ErrorClass::Transient,
            ..
        } => Fate::Requeue("db_unavailable"),
        // Systemic errors only end here at shutdown, or when the sink gives a batch back before
        // the broker's consumer_timeout: the message stays with the broker.
        Failure::Db { .. } => Fate::Settled(Disposition::Requeue),
    }
}

/// The DLQ stage actor.
pub struct DlqStage {
    fallback: Arc<Fallback>,
    max_attempts: u32,
}

impl DlqStage {
    pub fn new(fallback: Fallback, max_attempts: u32) -> Self {
        Self {
            fallback: Arc::new(fallback),
            max_attempts,
        }
    }
}

impl Actor for DlqStage {
    type Context = Context<Self>;
}

impl Supervised for DlqStage {}

impl Handler<Leftovers> for DlqStage {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, msg: Leftovers, _: &mut Self::Context) -> Self::Result {
        let fallback = self.fallback.clone();
        let max = self.max_attempts;
        Box::pin(async move {
            let Leftovers { batch_id, items } = msg;
            let mut fates: Vec<Fate> = items
                .iter()
                .map(|(d, f)| dlq_fate(f, &headers::dlq_attempts(&d.properties.full()), max))
                .collect();
            fallback.give_back_at_stop(&items, &mut fates);
            fallback.park_all(&items, &mut fates).await;
            // What goes back to the DLQ for another attempt waits a backoff first, so a
            // database that keeps refusing is never a hot loop. It grows with the pipeline's
            // streak of such batches, but never past what the batch's least tried message has
            // earned: with many poisoned rows the streak alone reached the 30 s cap, and every
            // later batch, first attempts included, waited that long (`DLQ_MAX_ATTEMPTS`
            // already bounds how often one message is tried). Those messages wait in a task of
            // their own, unacked; the rest of the batch settles now and the DLQ consumer goes
            // on.
            let is_attempt = |f: &Fate| matches!(f, Fate::Route(Route::DlqAttempt { .. }));
            let least = fates
                .iter()
                .filter_map(|f| match f {
                    Fate::Route(Route::DlqAttempt { attempts, .. }) => Some(*attempts),
                    _ => None,
                })
                .min();
            let Some(least) = least else {
                fallback.settle(&batch_id, items, fates, false).await;
                return;
            };
            let (attempts, rest): (Vec<_>, Vec<_>) = items
                .into_iter()
                .zip(fates)
                .partition(|(_, fate)| is_attempt(fate));
            let (rest_items, rest_fates): (Vec<_>, Vec<_>) = rest.into_iter().unzip();
            if !rest_items.is_empty() {
                fallback
                    .settle(&batch_id, rest_items, rest_fates, false)
                    .await;
            }
            let delay = fallback.within_hand_back(
                fallback.next_backoff_at_most(least),
                attempts.iter().map(|((d, _), _)| d.received_at).min(),
            );
            warn!(pipeline = fallback.stage.pipeline(), stage = fallback.stage.stage().as_str(), batch_id = %batch_id, count = attempts.len(),
                delay_ms = delay.as_millis() as u64,
                "the database refused DLQ messages; trying them again after a backoff");
            let (items, mut fates): (Vec<_>, Vec<_>) = attempts.into_iter().unzip();
            tokio::spawn(async move {
                let generation = items.iter().map(|(d, _)| d.generation).max();
                super::router::backoff_while_linked(
                    delay,
                    &fallback.stopping,
                    &fallback.copies,
                    generation.unwrap_or(0),
                )
                .await;
                fallback.route_all(&items, &mut fates).await;
                // What could not be republished is parked.
                fallback.park_all(&items, &mut fates).await;
                fallback.settle(&batch_id, items, fates, true).await;
            });
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(class: ErrorClass, server_answered: bool) -> Failure {
        Failure::Db {
            class,
            server_answered,
            reason: "boom".into(),
        }
    }

    #[test]
    fn every_failure_class_has_its_way_in_the_dlq_stage() {
        let refused = Failure::Refused {
            kind: ErrorKind::InvalidJson,
            reason: "eof".into(),
        };
        assert!(matches!(
            dlq_fate(&refused, &Retries::Count(0), 10),
            Fate::Park {
                kind: ErrorKind::InvalidJson,
                ..
            }
        ));
        assert!(matches!(
            dlq_fate(&db(ErrorClass::Permanent, true), &Retries::Count(0), 10),
            Fate::Park {
                kind: ErrorKind::DbPermanent,
                ..
            }
        ));
        assert_eq!(
            dlq_fate(&db(ErrorClass::Transient, true), &Retries::Count(3), 10),
            Fate::Route(Route::DlqAttempt {
                attempts: 4,
                reason: "boom".into(),
                waits: false,
            })
        );
        assert!(matches!(
            dlq_fate(&db(ErrorClass::Transient, true), &Retries::Count(9), 10),
            Fate::Park {
                kind: ErrorKind::RetriesExhausted,
                ..
            }
        ));
        // An unreadable count (headers the parser cut short) is never cycled.
        assert!(matches!(
            dlq_fate(&db(ErrorClass::Transient, true), &Retries::Unreadable, 10),
            Fate::Park {
                kind: ErrorKind::RetriesExhausted,
                ..
            }
        ));
        assert_eq!(
            dlq_fate(&db(ErrorClass::Transient, false), &Retries::Count(9), 10),
            Fate::Requeue("db_unavailable")
        );
        assert_eq!(
            dlq_fate(&db(ErrorClass::Systemic, true), &Retries::Count(0), 10),
            Fate::Settled(Disposition::Requeue)
        );
    }
}
