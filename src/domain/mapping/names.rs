//! The SQL names of a mapping: a table name (`schema.name` or `name`), the identifiers warren
//! takes, and how they are quoted.

use std::fmt;

/// A table name, split and checked: `schema.name` or `name` (then `DATABASE_SCHEMA`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: Option<String>,
    pub name: String,
}

impl TableName {
    pub fn parse(text: &str) -> Result<Self, TableNameError> {
        let parts: Vec<&str> = text.split('.').collect();
        let (schema, name) = match parts.as_slice() {
            [name] => (None, *name),
            [schema, name] => (Some(*schema), *name),
            _ => return Err(TableNameError::Parts(text.to_string())),
        };
        for part in schema.iter().chain([&name]) {
            identifier(part).map_err(|name| TableNameError::Name {
                table: text.to_string(),
                name,
            })?;
        }
        // warren's temporary tables (`warren_probe`, `warren_written`, `warren_snapshot_0`,
        // ...) come first on a session's path: a table of such a name given without its schema
        // would be one of them to warren's statements (review R41b F15: the pipeline held on
        // 42P10).
        if schema.is_none() && name.starts_with(TEMPORARY) {
            return Err(TableNameError::Reserved(text.to_string()));
        }
        Ok(Self {
            schema: schema.map(str::to_string),
            name: name.to_string(),
        })
    }

    /// The name quoted for SQL.
    pub fn sql(&self) -> String {
        match &self.schema {
            Some(s) => format!("{}.{}", quote(s), quote(&self.name)),
            None => quote(&self.name),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// Why a `table` is not one warren takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableNameError {
    #[error("table {0:?}: expected name or schema.name")]
    Parts(String),
    #[error("table {table:?}: {name}")]
    Name { table: String, name: NameError },
    #[error(
        "table {0:?}: names starting with warren_ are those of warren's temporary tables, which \
         hide a table given without its schema; give it with its schema (schema.{0})"
    )]
    Reserved(String),
}

/// How the names of warren's temporary tables begin (`pg_temp.warren_probe`, ...).
pub const TEMPORARY: &str = "warren_";

/// A table, schema or column name that is not an SQL identifier warren takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a name warren takes (letters, digits, _ and $, not starting with a digit, at \
     most 63 bytes)"
)]
pub struct NameError(pub String);

/// Checks a table, schema or column name: an SQL identifier warren quotes, so it is taken as
/// written (letters, digits, `_`, `$`; not starting with a digit; at most 63 bytes).
pub(super) fn identifier(name: &str) -> Result<(), NameError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit() || c == '$')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if ok {
        Ok(())
    } else {
        Err(NameError(name.to_string()))
    }
}

/// `name` quoted as an SQL identifier.
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `s` as an SQL string literal.
pub(super) fn sql_text(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
