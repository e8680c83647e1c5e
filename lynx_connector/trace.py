"""An opt-in timeline of each request across P, D and the proxy, for finding where latency goes.

``LYNX_TRACE=<path>`` in the environment of ``lynx serve`` / ``lynx proxy`` (or of any process running the
connector) appends one JSON line per event to ``<path>``: ``{"t": wall seconds, "who": "P"|"D"|"proxy", "key":
transfer id or request id, "ev": name, ...}``. P, D and the proxy on one machine share its clock, so their lines
line up (``benchmarks/timeline.py`` reads them). Unset (the default), every call is one dictionary lookup.
Nothing here is needed to serve: it only records. A path that cannot be written (no such folder, read-only or full
disk) or a field JSON cannot hold is logged as one warning per path and the event dropped: it never fails the
request it records.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from lynx_connector.logger import init_logger

__all__ = ["trace", "tracing"]

ENV = "LYNX_TRACE"
_lock = threading.Lock()
_warned: set[str] = set()  # paths whose failure has been logged
logger = init_logger(__name__)


def tracing() -> bool:
    return bool(os.environ.get(ENV))


def trace(who: str, key: str, ev: str, **fields: Any) -> None:
    """Record ``ev`` of request ``key`` now, if ``LYNX_TRACE`` names a file."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        line = json.dumps({"t": time.time(), "who": who, "key": key, "ev": ev, "pid": os.getpid(), **fields})
        with _lock, open(path, "a", encoding="utf-8") as f:  # one short O_APPEND write per line: no interleaving
            f.write(line + "\n")
    except (OSError, TypeError, ValueError) as e:
        if path not in _warned:
            _warned.add(path)
            logger.warning("%s=%s: cannot record the timeline (%s); its events are dropped", ENV, path, e)
