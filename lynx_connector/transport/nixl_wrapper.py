"""The only module that imports NIXL: a thin `NixlWrapper` around `nixl_agent`.

Tests inject `tests/transport/fakes.py::FakeNixlWrapper`, which has the same methods. Every method is called
from one thread at a time (the owner's service thread, or the constructor's thread before it starts).

Findings this relies on (NIXL 1.5.1, UCX 1.23 on a CPU box): with the default UCX transports RMA goes
through cma, so `transfer()` is synchronous and returns "DONE"; with `UCX_TLS=tcp` it returns "PROC" and is
polled. `add_remote_agent` returns bytes. Agent metadata must be read after `register_memory`.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from lynx_connector.logger import init_logger
from lynx_connector.transport.config import TransportConfig

logger = init_logger(__name__)

__all__ = ["NixlUnavailableError", "NixlLike", "NixlWrapper", "import_nixl", "nixl_available"]


class NixlUnavailableError(ImportError):
    """No NIXL Python package is installed (`nixl` or `nixl-cu12`)."""


def import_nixl() -> Any:
    """Return NIXL's `_api` module: `nixl._api` (meta package) if present, else `nixl_cu12._api`."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # try the next distribution
            errors.append(f"{name}: {exc}")
    raise NixlUnavailableError("NIXL is not installed (pip install nixl-cu12==1.5.1): " + "; ".join(errors))


def nixl_available() -> bool:
    try:
        import_nixl()
    except NixlUnavailableError:
        return False
    return True


class NixlLike(Protocol):
    """What the transport needs from NIXL (implemented by `NixlWrapper` and the test fake)."""

    name: str

    def register(self, tensor: torch.Tensor) -> None: ...
    def metadata(self) -> bytes: ...
    def add_remote(self, metadata: bytes) -> str: ...
    def remove_remote(self, peer: str) -> None: ...
    def post_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> tuple[Any, str]: ...
    def check(self, handle: Any) -> str: ...
    def release(self, handle: Any) -> None: ...
    def progress(self) -> dict[str, list[bytes]]: ...
    def close(self) -> None: ...


class NixlWrapper:
    """One NIXL agent with one backend, DRAM (or VRAM) registered once, single-descriptor READs."""

    def __init__(self, name: str, config: TransportConfig) -> None:
        api = import_nixl()
        self.name = name
        conf = api.nixl_agent_config(enable_prog_thread=config.progress_thread, backends=[])
        self._agent = api.nixl_agent(name, conf)
        self._agent.create_backend(config.backend, config.nixl_backend_params())
        self._registered: list[Any] = []
        self._mem_type = "DRAM"
        logger.debug(
            "NIXL agent %s: backend %s params %s prog_thread %s",
            name,
            config.backend,
            config.nixl_backend_params(),
            config.progress_thread,
        )

    def register(self, tensor: torch.Tensor) -> None:
        self._mem_type = "VRAM" if tensor.is_cuda else "DRAM"
        self._registered.append(self._agent.register_memory([tensor]))

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, peer: str) -> None:
        self._agent.remove_remote_agent(peer)

    def post_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> tuple[Any, str]:
        """READ `nbytes` from the peer's `remote_addr` into `local_addr`; returns (handle, DONE|PROC|ERR)."""
        local = self._agent.get_xfer_descs([(local_addr, nbytes, 0)], self._mem_type)
        remote = self._agent.get_xfer_descs([(remote_addr, nbytes, 0)], self._mem_type)
        handle = self._agent.initialize_xfer("READ", local, remote, peer, b"")
        try:
            state = self._agent.transfer(handle)
        except Exception:
            self._agent.release_xfer_handle(handle)
            raise
        return handle, state

    def check(self, handle: Any) -> str:
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)

    def progress(self) -> dict[str, list[bytes]]:
        """Drive the backend once (needed without a progress thread) and return new notifications."""
        return self._agent.get_new_notifs()

    def close(self) -> None:
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # teardown is best effort
                logger.warning("NIXL deregister failed on %s: %s", self.name, exc)
        self._registered.clear()
