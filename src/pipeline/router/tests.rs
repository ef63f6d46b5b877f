//! The router's rules: where each failure goes, the retry tiers, the requeue backoff.

use super::republisher::retry_tier;
use super::*;

fn db(class: ErrorClass) -> Failure {
    Failure::Db {
        class,
        server_answered: true,
        reason: "boom".into(),
    }
}

#[test]
fn every_failure_class_has_its_way_in_the_main_pipeline() {
    let refused = Failure::Refused {
        kind: ErrorKind::InvalidJson,
        reason: "eof".into(),
    };
    assert_eq!(
        main_fate(&refused, false),
        Fate::Route(Route::DeadLetter {
            kind: ErrorKind::InvalidJson,
            reason: "eof".into()
        })
    );
    assert_eq!(
        main_fate(&db(ErrorClass::Permanent), false),
        Fate::Route(Route::DeadLetter {
            kind: ErrorKind::DbPermanent,
            reason: "boom".into()
        })
    );
    assert_eq!(
        main_fate(&db(ErrorClass::Transient), false),
        Fate::Route(Route::Retry {
            reason: "boom".into()
        })
    );
    assert_eq!(
        main_fate(&db(ErrorClass::Systemic), false),
        Fate::Settled(Disposition::Requeue)
    );
    // A body over MAX_MESSAGE_BYTES is parked where it was refused; a database failure of
    // such a message (it never reaches the database) goes its usual way.
    assert_eq!(
        main_fate(&refused, true),
        Fate::Park {
            kind: ErrorKind::InvalidJson,
            reason: "eof".into()
        }
    );
    assert_eq!(
        main_fate(&db(ErrorClass::Transient), true),
        Fate::Route(Route::Retry {
            reason: "boom".into()
        })
    );
}

#[test]
fn the_nth_retry_waits_in_the_nth_tier_then_in_the_last() {
    let tiers: Vec<usize> = (1..=5).map(|n| retry_tier(n, 3)).collect();
    assert_eq!(tiers, [0, 1, 2, 2, 2]);
    // One tier (no RETRY_TTLS_MS): every retry in the retry queue.
    assert!((1..=100).all(|n| retry_tier(n, 1) == 0));
    // Never out of range, whatever the header said.
    assert_eq!(retry_tier(0, 3), 0);
    assert_eq!(retry_tier(u32::MAX, 3), 2);
}

#[test]
fn requeue_backoff_grows_from_200ms_to_30s() {
    let first = requeue_backoff(1);
    assert!(
        first >= Duration::from_millis(200) && first < Duration::from_millis(400),
        "{first:?}"
    );
    let later = requeue_backoff(5);
    assert!(later >= Duration::from_millis(3200), "{later:?}");
    let capped = requeue_backoff(40);
    assert!(
        capped >= Duration::from_secs(30) && capped < Duration::from_secs(60),
        "{capped:?}"
    );
}

/// Review R46a F7, F8: a redelivery the locked table of a replaced stage could not answer for
/// goes through the retry queue without counting a retry (the main stage), or back to the DLQ
/// without counting an attempt (the DLQ stage): never back to the head of its queue.
#[test]
fn a_message_waiting_for_a_locked_table_is_asked_again_uncounted() {
    let waits = Failure::Waits {
        reason: "locked".into(),
    };
    assert_eq!(
        main_fate(&waits, false),
        Fate::Route(Route::Wait {
            reason: "locked".into()
        })
    );
    assert_eq!(
        crate::pipeline::dlq::dlq_fate(&waits, &crate::amqp::headers::Retries::Count(3), 10),
        Fate::Route(Route::DlqAttempt {
            attempts: 3,
            reason: "locked".into(),
            waits: true,
        })
    );
}
