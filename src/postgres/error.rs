//! [`PgError`]: why a [`PgStore`](super::PgStore) could not connect.

use std::fmt;

/// Why [`PgStore::connect`](super::PgStore::connect) failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgError {
    /// A setting is wrong: the connection string does not parse, or a schema or table prefix
    /// is not a plain identifier (`[a-z_][a-z0-9_]*`, at most 40 bytes).
    Config(String),
    /// The server could not be reached: down, or a wrong host, port or socket directory.
    Unreachable(String),
    /// The server refused the credentials (a wrong password or user).
    Auth(String),
    /// A table the store uses exists with another shape: `table` names it, `detail` says what
    /// differs. Nothing was changed.
    Shape {
        /// The table, as `schema.name`.
        table: String,
        /// What differs.
        detail: String,
    },
    /// Any other error from the server (no rights to create the tables, say).
    Sql(String),
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PgError::Config(e) => write!(f, "bad PostgreSQL store setting: {e}"),
            PgError::Unreachable(e) => write!(f, "PostgreSQL is unreachable: {e}"),
            PgError::Auth(e) => write!(f, "PostgreSQL refused the credentials: {e}"),
            PgError::Shape { table, detail } => {
                write!(
                    f,
                    "table {table} has another shape than the store's: {detail}"
                )
            }
            PgError::Sql(e) => write!(f, "PostgreSQL error: {e}"),
        }
    }
}

impl std::error::Error for PgError {}

impl PgError {
    /// Sorts a driver error out: credentials, reachability, or the rest.
    pub(crate) fn from_driver(e: &tokio_postgres::Error) -> PgError {
        use tokio_postgres::error::SqlState;
        let text = e.to_string();
        let detail = e.as_db_error().map_or_else(
            || format!("{text}: {:?}", std::error::Error::source(e)),
            |d| d.message().to_owned(),
        );
        match e.code() {
            Some(c)
                if *c == SqlState::INVALID_PASSWORD
                    || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
            {
                PgError::Auth(detail)
            }
            Some(_) => PgError::Sql(detail),
            None => PgError::Unreachable(detail),
        }
    }
}
