"""The web UI's files (collector/web/), served as they are: the page, its scripts and styles."""

from __future__ import annotations

from pathlib import Path

from fleetprof.httpserve import HttpError, Request, Response

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}


def static(req: Request) -> Response:
    """/, /ui and /ui/ are the page; /ui/NAME and /app.NAME the files beside it, and nothing else."""
    name = req.path.rsplit("/", 1)[-1] or "index.html"
    if req.path in ("/ui",):
        name = "index.html"
    path = WEB_DIR / name
    if "/" in name or name.startswith(".") or not path.is_file() or path.suffix not in _CONTENT_TYPES:
        raise HttpError(404, f"no such page: {req.path}")
    return Response(path.read_bytes(), _CONTENT_TYPES[path.suffix])
