//! The records a copy question asks about, in rounds of distinct parent keys (as PostgreSQL
//! compares the key), so that each round can be written again in one statement: used by the
//! child probe's same-after-triggers question (`copies.rs`) and the re-insert (`reinsert.rs`).

use super::super::statements::ORD;
use super::super::{Mapping, quote};
use crate::db::error::DbError;

/// `asked` (indices into `records`, ordinals index + 1 in the parents' probe) in rounds of
/// distinct parent keys, as PostgreSQL compares the key (the first record of each key in the
/// first round, the second in the second, ...): a round's records can be written again in one
/// statement. Each alone when the key cannot be compared so.
pub(in crate::domain::mapping) async fn rounds(
    mapping: &Mapping,
    client: &deadpool_postgres::Client,
    asked: &[usize],
) -> Result<Vec<Vec<usize>>, DbError> {
    let alone = || asked.iter().map(|&i| vec![i]).collect();
    if asked.len() < 2 {
        return Ok(alone());
    }
    let keys: Vec<String> = mapping
        .key
        .iter()
        .map(|&i| format!("p.{}", quote(&mapping.columns[i].name)))
        .collect();
    let ords: Vec<i64> = asked.iter().map(|&i| i as i64 + 1).collect();
    client
        .batch_execute("SAVEPOINT warren_rounds")
        .await
        .map_err(DbError::from_pg)?;
    let found = client
        .query(
            &format!(
                "SELECT p.{ORD}, row_number() OVER (PARTITION BY {} ORDER BY p.{ORD}) \
                 FROM pg_temp.warren_probe AS p WHERE p.{ORD} = ANY($1)",
                keys.join(", ")
            ),
            &[&ords],
        )
        .await;
    client
        .batch_execute("ROLLBACK TO SAVEPOINT warren_rounds; RELEASE SAVEPOINT warren_rounds")
        .await
        .map_err(DbError::from_pg)?;
    let found = match found {
        Ok(found) => found,
        Err(e) if !crate::db::error::of_the_moment(&e) => return Ok(alone()),
        Err(e) => return Err(DbError::from_pg(e)),
    };
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for row in found {
        let (i, round) = (
            (row.get::<_, i64>(0) - 1) as usize,
            row.get::<_, i64>(1) as usize,
        );
        if rounds.len() < round {
            rounds.resize_with(round, Vec::new);
        }
        rounds[round - 1].push(i);
    }
    Ok(rounds)
}
