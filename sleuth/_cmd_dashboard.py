"""`sleuth dashboard RUN [RUN ...]`: serve the dashboard over run directories on 127.0.0.1."""
from __future__ import annotations

import argparse
import sys
import threading
import time
import webbrowser


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dashboard", help="browse runs in a local web dashboard (scalars, profile, dumps, diff, graph)",
        description="Serve a Dash dashboard over one or more run directories: run.json, scalars, "
        "histograms, profile, dump statistics, the diff of two runs and the IR graph. Runs still "
        "training refresh while the page is open. Binds 127.0.0.1 unless --host says otherwise.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories to show")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the runs to the network)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a further name the browser may use to reach the dashboard (a reverse "
                   "proxy's or tunnel's); requests naming any other host are refused")
    p.add_argument("--port", type=int, default=8050, help="port (default 8050; 0 picks a free one)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    p.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                   help="how often open pages check for new data (default 5; 0 turns it off)")
    p.set_defaults(run=_run)


def check_port(host: str, port: int) -> None:
    """CliError naming the port and `--port` when nothing can listen on `host:port` (another
    program holds it): said before any work, in one line, not in the web server's words after."""
    import socket

    from sleuth.cli import CliError

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise CliError(f"--host {host}: cannot resolve it ({e}); give an address such as "
                       "127.0.0.1") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as the server will: a port left in TIME_WAIT by a previous server is free to it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise CliError(f"port {port} on {host or '0.0.0.0'} is in use ({e.strerror or e}); "
                           f"stop the program holding it, or pick another with --port N") from e


def _run(args: argparse.Namespace) -> int:
    from sleuth.cli import CliError

    import dashboard

    try:
        app = dashboard.create_app(args.runs, refresh_s=args.refresh)
    except dashboard.DashboardError as e:
        raise CliError(str(e)) from e
    check_port(args.host, args.port)
    try:
        handle = dashboard.serve(app, host=args.host, port=args.port, background=True,
                                 allowed_hosts=args.allow_host)
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port} ({e}); pick another --port") from e
    assert handle is not None
    from dashboard._serve import is_loopback, served_urls

    urls = served_urls(args.host, handle.port)
    url = urls[0]
    print(f"Sleuth dashboard on {' '.join(urls)} ({len(args.runs)} run(s)); Ctrl-C stops it",
          flush=True)
    if not is_loopback(args.host):
        print(f"warning: --host {args.host or '0.0.0.0'} serves beyond this machine: anyone who "
              f"can reach port {handle.port} here can read these runs' files; there is no "
              f"login. Bind 127.0.0.1 and use an SSH tunnel to keep them private.",
              file=sys.stderr, flush=True)
    if not args.no_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    try:
        while True:  # the server runs in its thread; Ctrl-C lands here
            time.sleep(3600)
    finally:
        handle.close()
    return 0
