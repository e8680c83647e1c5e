"""Live counters of a transport endpoint written to a JSON file about once a second (``status_path``).

For benchmarks and debugging: vLLM's own metrics are updated only when the engine steps, so an idle engine
keeps showing its last busy step; this file is written by the endpoint's service thread, which also runs
when the engine is idle. The write is atomic (temporary file + rename); a failed write is logged once. Each
file names its writer's ``pid``: a process killed without a clean shutdown leaves its last file behind, and
readers (:func:`writer_alive`) skip the files of writers that no longer run.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

__all__ = ["StatusWriter", "STATUS_INTERVAL_S", "writer_alive"]

STATUS_INTERVAL_S = 1.0


class StatusWriter:
    def __init__(self, path: str | None, collect: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._collect = collect
        self._next = 0.0
        self._warned = False

    def due_in(self, now: float) -> float | None:
        """Seconds until the next write (None: writing is off)."""
        return None if self.path is None else max(0.0, self._next - now)

    def maybe_write(self, now: float | None = None) -> None:
        if self.path is None:
            return
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + STATUS_INTERVAL_S
        try:
            body = {"time": time.time(), "pid": os.getpid(), **self._collect()}
            # a fresh name (O_EXCL): a fixed one in a shared status_dir could be a planted link to another file
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".",
                                       prefix=f".{os.path.basename(self.path)}.")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(body, f, default=str)
                os.chmod(tmp, 0o644)  # readable like the file it replaces (mkstemp makes it 0600)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except Exception as exc:  # observability must never break the transport
            if not self._warned:
                logger.warning("lynx: cannot write status file %s: %s", self.path, exc)
                self._warned = True


def writer_alive(body: dict[str, Any]) -> bool:
    """Whether the process that wrote status ``body`` still runs (True for a file without a ``pid``, or one
    whose writer this process may not signal: it exists)."""
    pid = body.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
