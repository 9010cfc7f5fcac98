"""The pg_logical source: a PostgreSQL logical replication slot read with pgoutput."""
