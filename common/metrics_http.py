"""The /metrics endpoint, and nothing else: every other path is 404, so that an HTTP probe aimed
at this port by mistake fails instead of passing on the metrics text."""

from __future__ import annotations

import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # a scrape every few seconds would flood the log


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the process's exit


def metrics_only_app(registry: CollectorRegistry) -> Any:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Any) -> Any:
        if environ.get("PATH_INFO") in ("/metrics", "/metrics/"):
            return metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: this port serves /metrics only\n"]

    return app


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Starts the server on a daemon thread; returns (server, bound port)."""
    server = make_server(host, port, metrics_only_app(registry), _ThreadingServer, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server, server.server_port
