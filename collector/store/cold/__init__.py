"""The cold tier: DuckDB (database.py) written by the flusher (writer.py), kept in shape (maintenance.py),
read with the chunks not yet committed (chunk.py, queries.py)."""
