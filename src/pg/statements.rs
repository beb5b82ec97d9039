//! The building blocks of the order and cancel transactions' statements: a statement's text with
//! how it is planned, and one set-based statement run unless it has no rows.

/// A statement's text, and whether its prepared form is kept for the connection's life.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sql<'a> {
    /// Prepared once per connection (its plan reused on a [`super::PlanCache::Reuse`]
    /// connection).
    Cached(&'a str),
    /// Sent unnamed with its parameters' types, in one round trip: PostgreSQL plans it with
    /// its parameters even on a [`super::PlanCache::Reuse`] connection. For a statement that
    /// searches a table whose size a cached plan could misjudge (the inbox, reservations and
    /// orders of a sale that began a minute ago), on paths that are not every batch's.
    PerRun(&'a str, &'a [tokio_postgres::types::Type]),
}

impl<'a> From<&'a str> for Sql<'a> {
    fn from(sql: &'a str) -> Self {
        Sql::Cached(sql)
    }
}

/// Runs one set-based statement of a transaction, unless it has no rows to write: the order
/// and cancel transactions' building block.
pub(crate) async fn exec_unless_empty<'a, const N: usize>(
    tx: &deadpool_postgres::Transaction<'_>,
    empty: bool,
    sql: impl Into<Sql<'a>>,
    params: [&(dyn tokio_postgres::types::ToSql + Sync); N],
) -> Result<(), tokio_postgres::Error> {
    if empty {
        return Ok(());
    }
    match sql.into() {
        Sql::Cached(sql) => {
            let stmt = tx.prepare_cached(sql).await?;
            tx.execute(&stmt, &params).await?;
        }
        // The unnamed statement: parsed, bound and run in one round trip, and planned for
        // this run (PostgreSQL plans a statement's first five runs with their parameters).
        Sql::PerRun(sql, types) => {
            debug_assert_eq!(types.len(), N, "one type per parameter: {sql}");
            let typed: Vec<_> = params.iter().copied().zip(types.iter().cloned()).collect();
            tx.execute_typed(sql, &typed).await?;
        }
    }
    Ok(())
}
