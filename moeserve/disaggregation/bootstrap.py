"""The bootstrap server (on a prefill server, at disaggregation.bootstrap_port) and its client.

SGLang's router passes every request to both servers with the prefill's bootstrap host and port and
a random `bootstrap_room`. The decode rank that receives it asks this server which prefill rank
holds the room (rank room % dp_size: the prefill's tokenizer manager pins each room there) and how
to reach it; later it probes /health while it waits for KV (heartbeats).

Routes: GET /health → 200 {"status": "ok"}; GET /route → {"dp_size", "ranks": {dp_rank: info}},
503 until every rank announced itself.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moeserve.config import MoeserveConfig

logger = logging.getLogger(__name__)


class BootstrapServer:
    def __init__(self, host: str, port: int, route: Callable[[], dict | None]):
        """`route()`: the current route table, or None while ranks are still starting."""
        handler = type("Handler", (_Handler,), {"route": staticmethod(route)})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="pd-bootstrap",
                                        daemon=True)
        self._thread.start()
        logger.info("PD bootstrap server on %s:%d", host, port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    route: Callable[[], dict | None]

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/route":
            table = self.route()
            self._reply(200, table) if table else self._reply(503, {"error": "ranks starting"})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # per-request lines would flood the log
        pass


def serve_bootstrap(cfg: MoeserveConfig, ready: dict[tuple[str, int], dict]
                    ) -> BootstrapServer | None:
    """A PD prefill server's bootstrap server (None otherwise), serving the route table built from
    the ranks' ready messages (each scheduler's info["pd"]: its control endpoint and engine)."""
    if cfg.disaggregation.mode != "prefill":
        return None

    def route() -> dict | None:
        infos = {info["dp_rank"]: info["pd"] for (role, _), info in list(ready.items())
                 if role == "scheduler" and "pd" in info}
        return route_table(cfg.parallel.dp_size, infos)

    return BootstrapServer(cfg.server.host, cfg.disaggregation.bootstrap_port, route)


def route_table(dp_size: int, infos: dict[int, dict]) -> dict | None:
    """The table /route serves from the ranks' ready infos (by DP rank)."""
    if len(infos) < dp_size:
        return None
    return {"dp_size": dp_size, "ranks": {str(k): v for k, v in infos.items()}}


def fetch_route(host: str, port: int, timeout: float) -> dict:
    with urllib.request.urlopen(f"http://{host}:{port}/route", timeout=timeout) as r:
        return json.loads(r.read())


def probe(host: str, port: int, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False
