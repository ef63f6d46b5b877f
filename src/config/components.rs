//! The one place warren's settings become the components' own configurations: the database
//! layer's [`DbConfig`] (the layers below `config` read none of [`Settings`]).

use super::Settings;
use crate::db::DbConfig;

impl Settings {
    /// The database layer's configuration: `DATABASE_URL`, `DATABASE_SCHEMA`,
    /// `DATABASE_STATEMENT_TIMEOUT_MS`, and `DATABASE_POOL_SIZE` as the pool's size (the
    /// composition root raises it to what the pipelines hold).
    pub fn database(&self) -> DbConfig {
        DbConfig {
            url: self.database_url.clone(),
            schema: self.database_schema.clone(),
            statement_timeout_ms: self.database_statement_timeout_ms,
            pool_size: self.database_pool_size,
        }
    }
}

#[cfg(test)]
mod tests {
    /// The shipped defaults make a database configuration the database layer accepts, and
    /// each field comes from its own setting.
    #[test]
    fn the_defaults_make_a_valid_database_configuration() {
        let settings = crate::config::Settings::defaults();
        let db = settings.database();
        assert_eq!(db.validate(), Ok(()));
        assert_eq!(db.url, settings.database_url);
        assert_eq!(db.schema, settings.database_schema);
        assert_eq!(
            db.statement_timeout_ms,
            settings.database_statement_timeout_ms
        );
        assert_eq!(db.pool_size, settings.database_pool_size);
    }
}
