"""Serving an app: a werkzeug server on 127.0.0.1 (loopback unless told otherwise), in the
foreground for the CLI or in a background thread for tests and benchmarks."""
from __future__ import annotations

import threading
from typing import Any


class ServerHandle:
    """A server running in a thread; `close()` (idempotent, also on exiting `with`) stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.host, server.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=10)

    def remove(self) -> None:  # the house handle protocol
        self.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8050,
          background: bool = False) -> ServerHandle | None:
    """Serve a Dash app built by `create_app`.

    Args:
        host: the address to bind; 127.0.0.1 by default so nothing outside this machine sees it.
        port: the port; 0 picks a free one (read it from the returned handle).
        background: run in a daemon thread and return a handle; otherwise block until Ctrl-C.
    """
    from werkzeug.serving import WSGIRequestHandler, make_server

    class _Quiet(WSGIRequestHandler):
        def log_request(self, *args: object, **kwargs: object) -> None:
            pass  # one line per callback request drowns the terminal; errors still log

    server = make_server(host, port, app.server, threaded=True, request_handler=_Quiet)
    if not background:
        try:
            server.serve_forever()
        finally:
            server.server_close()
        return None
    thread = threading.Thread(target=server.serve_forever, name="sleuth-dashboard", daemon=True)
    thread.start()
    return ServerHandle(server, thread)
