//! The environment's settings in a SQLite catalog: one key-value table
//! (`settings`), written fenced like every write.

use rusqlite::{params, OptionalExtension};

use super::SqliteCatalog;
use crate::{ReadError, WriteError};

impl SqliteCatalog {
    /// The value of an environment setting, if it was ever recorded.
    pub fn setting(&mut self, key: &str) -> Result<Option<String>, ReadError> {
        Ok(self
            .conn
            .query_row("SELECT value FROM settings WHERE key = ?1", [key], |r| {
                r.get(0)
            })
            .optional()?)
    }

    /// Records an environment setting (replacing any value).
    pub fn set_setting(&mut self, key: &str, value: &str) -> Result<(), WriteError> {
        self.write(|tx| {
            tx.execute(
                "INSERT INTO settings (key, value) VALUES (?1, ?2) \
                 ON CONFLICT (key) DO UPDATE SET value = ?2",
                params![key, value],
            )?;
            Ok(())
        })
    }

    /// Every environment setting whose key starts with `prefix`, by key.
    pub fn settings_under(&mut self, prefix: &str) -> Result<Vec<(String, String)>, ReadError> {
        let mut stmt = self.conn.prepare(
            "SELECT key, value FROM settings WHERE substr(key, 1, ?2) = ?1 ORDER BY key",
        )?;
        let rows = stmt
            .query_map(params![prefix, prefix.len() as i64], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Removes an environment setting, if there is one.
    pub fn clear_setting(&mut self, key: &str) -> Result<(), WriteError> {
        self.write(|tx| {
            tx.execute("DELETE FROM settings WHERE key = ?1", [key])?;
            Ok(())
        })
    }
}
