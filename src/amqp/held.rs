//! A delivery's properties as the pipeline holds them while the message is in flight: a small
//! header table packed into one slice.
//!
//! The AMQP client parses a header table into a B-tree whose first node has room for 11 entries
//! (some 640 bytes) however few the table has; a window of 4,000 messages each carrying one
//! header (warren's own `x-published-ms`, a trace id) holds 2.5 MB of mostly empty nodes from
//! receipt to ack. [`HeldProperties::new`] moves the entries of a small table (at most
//! [`PACK_ENTRIES`] of them, [`PACK_BYTES`] parsed) into a slice of their own size: for one
//! header, some 60 bytes instead of 640. The entries are the client's own values, moved and
//! cloned, never re-encoded, so the table [`HeldProperties::full`] gives back is the one
//! received, entry for entry. A bigger table stays as it was (its nodes are full; cloning it at
//! each read would cost more than it saves).
//!
//! What reads a delivery's properties chooses: [`HeldProperties::bare`] for every property but
//! the header table (the message id for a log line, a property column), without cost;
//! [`HeldProperties::full`] for all of them, the table rebuilt when it was packed (routing a
//! failed message, a mapping that reads headers).

use std::borrow::Cow;
use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// The most entries a header table may have to be packed.
pub const PACK_ENTRIES: usize = 32;
/// The most bytes a header table may take once parsed (`headers::parsed_bytes`' reckoning) to
/// be packed: what rebuilding it costs at a read stays small.
pub const PACK_BYTES: usize = 4096;

/// A delivery's properties, a small header table packed ([module docs](self)).
#[derive(Debug, Clone, Default)]
pub struct HeldProperties {
    /// Every property; its header table is an empty one when the table is packed.
    bare: BasicProperties,
    /// The header table's entries in key order, when packed.
    packed: Option<Box<[(ShortString, AMQPValue)]>>,
}

impl HeldProperties {
    /// Holds `properties`, packing a small header table.
    pub fn new(properties: BasicProperties) -> Self {
        let small = properties.headers().as_ref().filter(|t| {
            !t.inner().is_empty()
                && t.inner().len() <= PACK_ENTRIES
                && super::headers::table_bytes(t) <= PACK_BYTES
        });
        let Some(table) = small else {
            return Self {
                bare: properties,
                packed: None,
            };
        };
        let packed = table
            .inner()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Self {
            // An empty table allocates nothing; the B-tree of the received one is freed here.
            bare: properties.with_headers(FieldTable::default()),
            packed: Some(packed),
        }
    }

    /// Every property but the header table, which is not here when it was packed: for what
    /// reads no header.
    pub fn bare(&self) -> &BasicProperties {
        &self.bare
    }

    /// Every property, the header table as received (rebuilt when packed).
    pub fn full(&self) -> Cow<'_, BasicProperties> {
        match &self.packed {
            None => Cow::Borrowed(&self.bare),
            Some(entries) => {
                let table: BTreeMap<ShortString, AMQPValue> = entries.iter().cloned().collect();
                Cow::Owned(self.bare.clone().with_headers(FieldTable::from(table)))
            }
        }
    }

    /// Whether the header table is packed (for tests and the memory notes).
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }
}

impl From<BasicProperties> for HeldProperties {
    fn from(properties: BasicProperties) -> Self {
        Self::new(properties)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString};

    fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    #[test]
    fn a_small_table_is_packed_and_given_back_entry_for_entry() {
        let headers = table(&[
            ("x-published-ms", AMQPValue::LongLongInt(1_700_000_000_000)),
            (
                "b",
                AMQPValue::LongString(LongString::from(vec![0xff, 0, 1])),
            ),
            (
                "a",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void])),
            ),
            (
                "nested",
                AMQPValue::FieldTable(table(&[("k", AMQPValue::Boolean(true))])),
            ),
        ]);
        let p = BasicProperties::default()
            .with_message_id(ShortString::from("m-1"))
            .with_headers(headers.clone());
        let held = HeldProperties::new(p.clone());
        assert!(held.is_packed());
        assert_eq!(*held.full(), p);
        assert_eq!(held.bare().message_id(), p.message_id());
    }

    #[test]
    fn no_table_an_empty_one_and_a_big_one_stay_as_they_are() {
        for p in [
            BasicProperties::default(),
            BasicProperties::default().with_headers(FieldTable::default()),
            BasicProperties::default().with_headers(table(&[(
                "big",
                AMQPValue::LongString(LongString::from(vec![b'x'; PACK_BYTES])),
            )])),
            BasicProperties::default().with_headers(
                (0..=PACK_ENTRIES)
                    .map(|i| (ShortString::from(format!("k{i}")), AMQPValue::Void))
                    .collect::<BTreeMap<_, _>>()
                    .into(),
            ),
        ] {
            let held = HeldProperties::new(p.clone());
            assert!(!held.is_packed(), "{p:?}");
            assert!(matches!(held.full(), Cow::Borrowed(_)));
            assert_eq!(*held.full(), p);
        }
    }
}
