"""HTTP/2 probes get a quiet answer.

A client may open a connection with HTTP/2's prior-knowledge preface (`PRI * HTTP/2.0`), as
sglang-router does once per worker to learn whether the worker speaks HTTP/2. This server speaks
HTTP/1.1 only, so the probe must fail, and the client then talks HTTP/1.1; uvicorn answers it as
an invalid request with a 400 but also logs `Invalid HTTP request received.` as a warning, once
per probe, which reads like a fault. Here the same 400 goes out without the warning (a debug line
instead); every other invalid request is still logged by uvicorn.
"""

from __future__ import annotations

import logging
import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n"


def quiet_http2_probes(config: uvicorn.Config) -> None:
    """Make `config` serve HTTP/1.1 through its protocol class with quiet HTTP/2 probes (before
    the server loads the config)."""
    base = config.http
    if isinstance(base, str):
        base = import_from_string(HTTP_PROTOCOLS.get(base, base))
    if getattr(base, "answers_http2_probes", False) or not hasattr(base, "send_400_response"):
        return

    class QuietProbes(base):  # type: ignore[misc, valid-type]
        answers_http2_probes = True
        _seen_bytes = False

        def data_received(self, data: bytes) -> None:
            first, self._seen_bytes = not self._seen_bytes, True
            if first and data.startswith(PREFACE):
                logger.debug("HTTP/2 prior-knowledge probe from %s: answered 400 (HTTP/1.1 only)",
                             getattr(self, "client", None))
                self.send_400_response("This server speaks HTTP/1.1.")
                return
            super().data_received(data)

    QuietProbes.__name__ = f"QuietProbes{base.__name__}"
    config.http = QuietProbes
