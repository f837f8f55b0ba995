"""Ingest: batches from agents checked (validate.py), decoded into the model's rows (decode.py) and handed
to the store by the gRPC service (service.py)."""
