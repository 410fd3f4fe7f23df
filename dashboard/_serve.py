"""Serving an app: a werkzeug server on 127.0.0.1 (loopback unless told otherwise), in the
foreground for the CLI or in a background thread for tests and benchmarks; the names and URLs
a bound address serves, kept in the Flask config where the Host-header check
(dashboard._routes) reads them."""
from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterable
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ALLOWED_HOSTS = "SLEUTH_ALLOWED_HOSTS"
"""Key of `server.config`: the Host names this server answers to (set by `serve`)."""
ANY_ADDRESS = "SLEUTH_ANY_ADDRESS"
"""Key of `server.config`: True (bound to every interface) also accepts any IP address as Host.
An address cannot be rebound to another machine the way a DNS name can, and a host's own
list of addresses (getaddrinfo of its name) often misses interfaces a browser reaches."""
_WILDCARDS = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """True when binding `host` keeps the dashboard on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _addresses() -> list[str]:
    """This machine's non-loopback addresses, as far as its host name resolves."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return []
    return sorted({str(i[4][0]) for i in infos if not is_loopback(str(i[4][0]))})


def served_names(host: str) -> set[str]:
    """The Host names a server bound to `host` answers to: loopback names, the bound address,
    and for a wildcard (0.0.0.0, ::) this machine's host names and addresses."""
    names = set(LOOPBACK_NAMES)
    if host not in _WILDCARDS:
        names.add(host.strip("[]").lower())
        return names
    for name in (socket.gethostname(), socket.getfqdn()):
        names.add(name.lower())
    names.update(_addresses())
    return names


def served_urls(host: str, port: int) -> list[str]:
    """URLs that reach a server bound to `host`: the bound address itself, or for a wildcard
    127.0.0.1 first (what a browser on this machine opens), then this machine's name and
    addresses (what other machines open)."""
    def url(name: str) -> str:
        return f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/"

    if host not in _WILDCARDS:
        return [url(host.strip("[]"))]
    return [url("127.0.0.1"), url(socket.gethostname()), *map(url, _addresses())]


class ServerHandle:
    """A server running in a thread; `close()` (idempotent, also on exiting `with`) stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.host, server.port

    @property
    def url(self) -> str:
        return served_urls(self.host, self.port)[0].rstrip("/")

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


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 8050, background: bool = False,
          allowed_hosts: Iterable[str] = ()) -> ServerHandle | None:
    """Serve a Dash app built by `create_app`.

    Args:
        host: the address to bind; 127.0.0.1 by default so nothing outside this machine sees it.
        port: the port; 0 picks a free one (read it from the returned handle).
        background: run in a daemon thread and return a handle; otherwise block until Ctrl-C.
        allowed_hosts: more names the Host header may carry (a reverse proxy's, a tunnel's),
            beyond `served_names(host)`; any other Host is refused (DNS rebinding).
    """
    from werkzeug.serving import WSGIRequestHandler, make_server

    class _Quiet(WSGIRequestHandler):
        def log_request(self, *args: object, **kwargs: object) -> None:
            pass  # one line per callback request drowns the terminal; errors still log

    names = served_names(host) | {h.strip("[]").lower() for h in allowed_hosts}
    app.server.config[ALLOWED_HOSTS] = frozenset(app.server.config.get(ALLOWED_HOSTS, ())) | names
    app.server.config[ANY_ADDRESS] = app.server.config.get(ANY_ADDRESS) or host in _WILDCARDS
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
