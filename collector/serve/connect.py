"""Connect unary RPCs (connectrpc.com/docs/protocol) on the collector's HTTP server: what Grafana's stock
Pyroscope datasource and any Connect client speak.

A call is `POST /<package.Service>/<Method>` with an unframed message as the body: `application/proto`
(binary; what Grafana's backend sends) or `application/json` (proto3 JSON; curl, Profiles Drilldown),
optionally gzipped (`Content-Encoding`). The answer is the response message in the same codec, gzipped
when the client accepts it, or an error: JSON `{"code", "message"}` under the HTTP status the protocol
gives that code."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from fleetprof.httpserve import HttpError, Request, Response

# Connect's codes and their HTTP statuses (connectrpc.com/docs/protocol#error-codes).
CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}
# The code for an error the HTTP server raises itself (no such route, no token, too big, over budget).
_STATUS_CODE = {
    400: "invalid_argument",
    401: "unauthenticated",
    404: "unimplemented",
    408: "deadline_exceeded",
    411: "invalid_argument",
    413: "resource_exhausted",
    414: "resource_exhausted",
    415: "invalid_argument",
    422: "resource_exhausted",
    431: "resource_exhausted",
    501: "unimplemented",
    503: "unavailable",
    505: "unimplemented",
}
_CODECS = {"application/proto": "proto", "application/json": "json"}
MAX_MESSAGE_BYTES = 16 << 20  # a request's size once inflated
COMPRESS_ABOVE = 1024  # smaller answers go as they are: gzip would cost more than it saves


class ConnectError(Exception):
    """Raised by a method to answer with a Connect error `code` (a key of CODE_STATUS)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def error_response(code: str, message: str, status: int | None = None) -> Response:
    body = json.dumps({"code": code, "message": message}, separators=(",", ":")).encode()
    return Response(body, "application/json", status or CODE_STATUS[code])


def connect_error(status: int, message: str) -> Response:
    """An error the HTTP server met (no token, no such route, too big, over budget), as Connect's.
    A path with no service behind it keeps its 404, which Connect clients read as unimplemented; an answer
    over the server's size bound (422) is resource_exhausted under Connect's own status for it."""
    code = _STATUS_CODE.get(status, "internal")
    return error_response(code, message, CODE_STATUS[code] if status == 422 else status)


@dataclass(frozen=True)
class Encoded:
    """An answer a method has serialized already (a pprof Profile, written by render/pprof.py): sent as it
    is to a proto client, read into its message only for a JSON one."""

    message: type[Message]
    data: bytes


@dataclass(frozen=True)
class Method:
    request: type[Message]
    call: Callable[[Message], Message | Encoded]


class ConnectService:
    """One protobuf service's unary methods under `/<service>/`. `pending` names the service's methods
    this server does not serve: they answer `unimplemented` (501); a name the service does not have is a
    404, as a Connect server's router answers."""

    def __init__(self, service: str, methods: dict[str, Method], pending: tuple[str, ...] = ()):
        self.prefix = f"/{service}/"
        self._methods = methods
        self._pending = frozenset(pending)

    def handle(self, req: Request) -> Response:
        name = req.path[len(self.prefix) :]
        method = self._methods.get(name)
        if method is None:
            if name in self._pending:
                return error_response("unimplemented", f"{self.prefix[1:]}{name} is not served by fleetprof")
            return error_response("unimplemented", f"no such method: {req.path}", 404)
        try:
            codec = self._codec(req)
            message = self._decode(req, codec, method.request)
            answer = method.call(message)
        except ConnectError as err:
            return error_response(err.code, err.message)
        except HttpError as err:
            return connect_error(err.status, err.message)
        if codec == "proto":
            data = answer.data if isinstance(answer, Encoded) else answer.SerializeToString()
            body, content_type = data, "application/proto"
        else:
            if isinstance(answer, Encoded):
                answer = answer.message.FromString(answer.data)
            body, content_type = json_format.MessageToJson(answer, indent=None).encode(), "application/json"
        headers = {}
        if len(body) > COMPRESS_ABOVE and _accepts_gzip(req.headers.get("accept-encoding", "")):
            body, headers["Content-Encoding"] = gzip.compress(body, compresslevel=5), "gzip"
        return Response(body, content_type, headers=headers)

    @staticmethod
    def _codec(req: Request) -> str:
        version = req.headers.get("connect-protocol-version")
        if version not in (None, "1"):
            raise ConnectError("invalid_argument", f'connect-protocol-version must be "1", not {version!r}')
        media = req.headers.get("content-type", "").split(";")[0].strip().lower()
        codec = _CODECS.get(media)
        if codec is None:
            raise HttpError(
                415, f"content-type {media or '(none)'!r}: use application/proto or application/json"
            )
        return codec

    @staticmethod
    def _decode(req: Request, codec: str, cls: type[Message]) -> Message:
        body = req.body
        encoding = req.headers.get("content-encoding", "identity").strip().lower()
        if encoding == "gzip":
            body = _gunzip(body)
        elif encoding != "identity":
            raise ConnectError("unimplemented", f"content-encoding {encoding!r}: use gzip or identity")
        try:
            if codec == "proto":
                return cls.FromString(body)
            # Fields we do not define (Pyroscope's newer ones) are ignored, as Pyroscope ignores them.
            return json_format.Parse(body, cls(), ignore_unknown_fields=True)
        except (DecodeError, json_format.ParseError, UnicodeDecodeError, RecursionError) as err:
            raise ConnectError(
                "invalid_argument", f"cannot read the request as {cls.DESCRIPTOR.full_name}: {err}"
            ) from None


def _gunzip(data: bytes) -> bytes:
    """Inflate at most MAX_MESSAGE_BYTES: a small gzip bomb is a clear error, not a gigabyte in memory."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(data, MAX_MESSAGE_BYTES + 1)
    except zlib.error as err:
        raise ConnectError("invalid_argument", f"the gzipped request does not inflate: {err}") from None
    if len(out) > MAX_MESSAGE_BYTES or inflater.unconsumed_tail:
        raise ConnectError("resource_exhausted", f"the request inflates past {MAX_MESSAGE_BYTES} bytes")
    return out


def _accepts_gzip(header: str) -> bool:
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            return "q=0" not in params.replace(" ", "") or "q=0." in params.replace(" ", "")
    return False
