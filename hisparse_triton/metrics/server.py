"""``MetricsServer``: an HTTP endpoint for a ``HiSparseMetrics`` on a background thread (needs
``prometheus_client``: the ``metrics`` extra).

``GET /metrics`` answers the Prometheus text format of a registry holding one
``HiSparseCollector``; ``GET /verdict`` the verdict in one line (``text/plain``). Any other
path is a 404. A scrape reads published samples only (``HiSparseMetrics``), never the
device, so the serving loop is not slowed down. A stack that already serves Prometheus
registers ``metrics.collector()`` in its own registry instead.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from hisparse_triton.metrics.prometheus import HiSparseCollector, require_prometheus


class MetricsServer:
    """Serve ``metrics`` on ``host:port`` (``port=0``: a free port; ``port`` and ``url``
    say which) until ``close()``; also a context manager."""

    def __init__(self, metrics: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        prom = require_prometheus()
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}.")
        registry = prom.CollectorRegistry()
        registry.register(HiSparseCollector(metrics))
        generate, content_type = prom.generate_latest, prom.CONTENT_TYPE_LATEST

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, kind = generate(registry), content_type
                elif path == "/verdict":
                    body = (metrics.verdict_text() + "\n").encode()
                    kind = "text/plain; charset=utf-8"
                else:
                    self.send_error(404, "try /metrics or /verdict")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}."
                             ) from None
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._server.serve_forever, name="hisparse-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MetricsServer"]
