"""The ingest token check: a gRPC server interceptor that ends a call without `authorization: Bearer TOKEN`
(a token from the --auth-token-file) with UNAUTHENTICATED, before any batch is read."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from fleetprof.auth import TokenFile, presented_token

log = logging.getLogger(__name__)

_SAY_EVERY_S = 60.0  # a client retrying with a wrong token is logged once a minute, not per call


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: TokenFile, on_refused: Callable[[], None] | None = None):
        self._tokens = tokens
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._said_at = -_SAY_EVERY_S
        self._refused_since_said = 0

        def refuse(request_iterator: object, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid ingest token is required (--auth-token-file)"
            )

        self._refuse = grpc.stream_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        value = ""
        for key, v in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                value = v if isinstance(v, str) else v.decode("utf-8", "replace")
                break
        token = presented_token(value)
        if token is not None and self._tokens.accepts(token):
            return continuation(handler_call_details)
        self._refused(handler_call_details.method, "no token" if token is None else "a wrong token")
        return self._refuse

    def _refused(self, method: str, why: str) -> None:
        if self._on_refused is not None:
            self._on_refused()
        now = time.monotonic()
        with self._lock:
            self._refused_since_said += 1
            if now - self._said_at < _SAY_EVERY_S:
                return
            count, self._refused_since_said, self._said_at = self._refused_since_said, 0, now
        log.warning("refused %d ingest call(s) (%s) with %s: UNAUTHENTICATED", count, method, why)
