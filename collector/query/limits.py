"""How large an answer may be: flame-graph nodes, listed label names and values, series label sets."""

from __future__ import annotations

# Nodes of a flame graph besides its root. The UI's default keeps every frame wider than ~0.5 px of a
# 1200 px graph in practice, small enough that a browser draws it at once; Grafana asks for Pyroscope's
# 8,192. The long tail of each kept frame is merged into one "other" frame (render/tree.py, truncate).
DEFAULT_MAX_NODES = 2048
PYROSCOPE_MAX_NODES = 8192
MAX_NODES = 1_000_000

# Label names and values listed per request unless `limit` asks for more (at most MAX_LISTED): one node's
# labels are capped at ingest (ingest/quota.py), a fleet's are not, and a listing answered 200 MB once.
DEFAULT_LISTED = 1_000
MAX_LISTED = 10_000
MAX_MATCH = 16  # match[] selectors per listing
# Pyroscope's listings take no limit: the first this many, sorted.
MAX_LABEL_VALUES = 10_000
MAX_SERIES_LABEL_SETS = 10_000


class LimitError(ValueError):
    """A size asked for that is out of bounds; the message names it."""


def check_max_nodes(max_nodes: int) -> int:
    if not 0 < max_nodes <= MAX_NODES:
        raise LimitError(f"max_nodes must be between 1 and {MAX_NODES}, got {max_nodes}")
    return max_nodes
