//! The environment's settings in a PostgreSQL catalog: one key-value
//! table (`catalog_settings`), written fenced like every write.

use lockstep_pg::Session;

use super::PgCatalog;
use crate::{ReadError, WriteError};

impl PgCatalog {
    /// The value of an environment setting, if it was ever recorded.
    pub(crate) fn setting(&mut self, key: &str) -> Result<Option<String>, ReadError> {
        let key = key.to_string();
        self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                let row = s
                    .client
                    .query_opt("SELECT value FROM catalog_settings WHERE key = $1", &[&key])
                    .await?;
                Ok(row.map(|r| r.get(0)))
            })
        })
    }

    /// Every environment setting whose key starts with `prefix`, by key.
    pub(crate) fn settings_under(
        &mut self,
        prefix: &str,
    ) -> Result<Vec<(String, String)>, ReadError> {
        let prefix = prefix.to_string();
        self.conn.run(move |s: &mut Session| {
            Box::pin(async move {
                let rows = s
                    .client
                    .query(
                        "SELECT key, value FROM catalog_settings \
                         WHERE left(key, length($1)) = $1 ORDER BY key",
                        &[&prefix],
                    )
                    .await?;
                Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
            })
        })
    }

    /// Removes an environment setting, if there is one.
    pub(crate) fn clear_setting(&mut self, key: &str) -> Result<(), WriteError> {
        let key = key.to_string();
        self.write(move |c| {
            Box::pin(async move {
                c.execute("DELETE FROM catalog_settings WHERE key = $1", &[&key])
                    .await?;
                Ok(())
            })
        })
    }

    /// Records an environment setting (replacing any value).
    pub(crate) fn set_setting(&mut self, key: &str, value: &str) -> Result<(), WriteError> {
        let (key, value) = (key.to_string(), value.to_string());
        self.write(move |c| {
            Box::pin(async move {
                c.execute(
                    "INSERT INTO catalog_settings (key, value) VALUES ($1, $2) \
                     ON CONFLICT (key) DO UPDATE SET value = $2",
                    &[&key, &value],
                )
                .await?;
                Ok(())
            })
        })
    }
}
