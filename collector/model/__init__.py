"""The collector's data model: the values ingest, stores, queries and renderers exchange."""
