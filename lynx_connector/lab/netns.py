"""Separate "hosts" on one machine: network namespaces joined by veth links, shaped with ``tc`` (as root).

Prefill, decode and the proxy each get a namespace of their own; a veth pair per link carries addresses from a
private subnet (``10.213.<link>.0/30``) that exist only inside the namespaces created here, so KV crosses a real
network path (UCX over TCP through the kernel stack) instead of loopback shared memory. Nothing is routed out of a
namespace: a process inside can reach only its own ``lo`` and the far end of its links.

    with Topology() as topo:                     # destroyed on exit, also on failure
        p, d = topo.add_namespace("p"), topo.add_namespace("d")
        link = topo.add_link(p, d)               # link.addr_a (in p) <-> link.addr_b (in d)
        topo.shape(p, link.dev_a, rate_mbit=400) # tbf on P's egress (the KV direction)
        topo.exec_argv(p, ["python", ...])       # ip netns exec <p> ...
        with entered(d): start a process here    # the calling thread joins the namespace, then returns

Link faults, all reversible: ``set_link_up`` (``ip link set down/up``), ``blackhole`` (every packet dropped: a
100% loss without the interface going down), ``set_loss`` (random loss). The kernel here has no ``netem``, so
loss is built from what it has: an HTB root whose "drop" class ends in a zero-length FIFO, fed by a classic-BPF
classifier on the kernel's random number (``ld rand``). Delay: ``add_wire`` joins two namespaces with a TAP
device in each instead of a veth, bridged by a thread of this process that holds every frame for a fixed
one-way delay (a "long cable"; slower than a veth, meant for delay cases only).

Namespaces are named ``lynx<pid>x<n><role>``; :func:`cleanup_stale` removes those whose creating process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import itertools
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

__all__ = ["Link", "NetnsError", "Topology", "Wire", "available", "cleanup_stale", "enter_process", "entered",
           "netem_available", "SUBNET"]

#: First two octets of every address handed out here (RFC 1918 private space).
SUBNET = "10.213"
_NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_NAME_RE = re.compile(r"^lynx(\d+)x\d+[a-z0-9]*$")
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be created here (root and iproute2), else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (Debian: apt-get install -y iproute2)"
    return True, ""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay/jitter); probed in a throwaway namespace."""
    ok, _ = available()
    if not ok:
        return False
    with Topology() as topo:
        ns = topo.add_namespace("probe")
        _run(["ip", "-n", ns, "link", "add", "probe0", "type", "dummy"], check=False)
        res = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "probe0", "root", "netem",
                    "delay", "1ms"], check=False)
        return res.returncode == 0


@dataclass(frozen=True)
class Link:
    """One veth pair: ``dev_a`` with ``addr_a`` in namespace ``ns_a``, ``dev_b``/``addr_b`` in ``ns_b``."""

    ns_a: str
    dev_a: str
    addr_a: str
    ns_b: str
    dev_b: str
    addr_b: str
    mtu: int

    def end(self, ns: str) -> tuple[str, str]:
        """(device, address) of this link inside namespace ``ns``."""
        if ns == self.ns_a:
            return self.dev_a, self.addr_a
        if ns == self.ns_b:
            return self.dev_b, self.addr_b
        raise KeyError(f"link {self.dev_a}<->{self.dev_b} has no end in {ns}")

    def peer_addr(self, ns: str) -> str:
        """The address at the other end, seen from ``ns``."""
        return self.addr_b if ns == self.ns_a else self.addr_a


class Topology:
    """Namespaces and veth links owned by this object; :meth:`destroy` (or leaving the ``with``) removes all
    of them, also after a failure half-way. Deleting a namespace deletes its veth ends and qdiscs."""

    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise NetnsError(f"network namespaces unavailable: {why}")
        self._tag = f"lynx{os.getpid()}x{next(_counter)}"
        self.namespaces: list[str] = []
        self.links: list[Link] = []
        self._links_made = 0
        self.wires: list[Wire] = []

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ---- building ----
    def add_namespace(self, role: str) -> str:
        """Create namespace ``<tag><role>`` with ``lo`` up; returns its name."""
        if not re.fullmatch(r"[a-z0-9]{1,8}", role):
            raise ValueError(f"role must be 1-8 lowercase letters/digits, got {role!r}")
        name = self._tag + role
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    @staticmethod
    def link_addrs(k: int) -> tuple[str, str]:
        """Addresses of the k-th link (1-based) of any topology: (a end, b end). Topologies are isolated from
        each other, so every topology numbers its links from 1 and the addresses are known before creation."""
        if not 1 <= k <= 250:
            raise ValueError(f"link index must be in [1, 250], got {k}")
        return f"{SUBNET}.{k}.1", f"{SUBNET}.{k}.2"

    @staticmethod
    def link_devs(role_a: str, role_b: str) -> tuple[str, str]:
        """Device names of a link between roles a and b: ``to-<b>`` (in a), ``to-<a>`` (in b)."""
        return f"to-{role_b}"[:15], f"to-{role_a}"[:15]

    def add_link(self, ns_a: str, ns_b: str, *, mtu: int = 9000) -> Link:
        """A veth pair between two of this topology's namespaces; the k-th link is addressed ``10.213.<k>.1/30``
        (a) and ``.2`` (b) (:meth:`link_addrs`). Device names say where the other end is (:meth:`link_devs`)."""
        for ns in (ns_a, ns_b):
            if ns not in self.namespaces:
                raise ValueError(f"{ns} is not a namespace of this topology")
        self._links_made += 1
        addr_a, addr_b = self.link_addrs(self._links_made)
        dev_a, dev_b = self.link_devs(ns_a[len(self._tag):], ns_b[len(self._tag):])
        _run(["ip", "link", "add", "name", dev_a, "netns", ns_a, "mtu", str(mtu), "type", "veth",
              "peer", "name", dev_b, "netns", ns_b, "mtu", str(mtu)])
        link = Link(ns_a, dev_a, addr_a, ns_b, dev_b, addr_b, mtu)
        for ns, dev, addr in ((ns_a, dev_a, link.addr_a), (ns_b, dev_b, link.addr_b)):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.links.append(link)
        logger.info("veth %s:%s(%s) <-> %s:%s(%s) mtu %d", ns_a, dev_a, link.addr_a, ns_b, dev_b, link.addr_b, mtu)
        return link

    def add_wire(self, ns_a: str, ns_b: str, *, delay_ms: float, mtu: int = 9000) -> Link:
        """Like :meth:`add_link`, but a TAP device in each namespace and a :class:`Wire` thread between them
        that delays every frame by ``delay_ms`` one way (RTT = 2 x delay). Stopped by :meth:`destroy`."""
        for ns in (ns_a, ns_b):
            if ns not in self.namespaces:
                raise ValueError(f"{ns} is not a namespace of this topology")
        self._links_made += 1
        addr_a, addr_b = self.link_addrs(self._links_made)
        dev_a, dev_b = self.link_devs(ns_a[len(self._tag):], ns_b[len(self._tag):])
        fds = []
        try:
            for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
                with entered(ns):  # the TAP device is created in the calling thread's namespace
                    fds.append(_open_tap(dev))
                _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu)])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        wire = Wire(fds[0], fds[1], delay_ms / 1e3, mtu)
        wire.start()
        self.wires.append(wire)
        link = Link(ns_a, dev_a, addr_a, ns_b, dev_b, addr_b, mtu)
        self.links.append(link)
        logger.info("wire %s:%s(%s) <-> %s:%s(%s), %.1f ms one way", ns_a, dev_a, addr_a, ns_b, dev_b, addr_b,
                    delay_ms)
        return link

    # ---- shaping and faults (egress of `dev` in `ns`) ----
    def _tc(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "netns", "exec", ns, "tc", *args], check=check)

    def clear(self, ns: str, dev: str) -> None:
        """Back to the default qdisc (no shaping, no loss)."""
        self._tc(ns, "qdisc", "del", "dev", dev, "root", check=False)

    def shape(self, ns: str, dev: str, rate_mbit: float, *, burst_bytes: int | None = None,
              queue_ms: float = 200.0) -> None:
        """Token-bucket filter at ``rate_mbit`` (Mbit/s on the wire, headers included) on ``dev``'s egress.
        The bucket holds ``burst_bytes`` (default: 2 ms of the rate, at least 64 KiB, because veth hands tbf
        GSO packets of up to 64 KiB); the queue holds ``queue_ms`` of the rate before tail drop."""
        rate_bps = rate_mbit * 1e6 / 8
        burst = burst_bytes or max(64 << 10, int(rate_bps * 0.002))
        limit = max(burst * 2, int(rate_bps * queue_ms / 1e3))
        self._tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                 "burst", str(burst), "limit", str(limit))

    def set_loss(self, ns: str, dev: str, probability: float) -> None:
        """Drop each egress packet of ``dev`` with ``probability`` (0 < p <= 1), no shaping otherwise.
        HTB class 1:20 has a zero-length FIFO (drops); a classic-BPF filter on the kernel's random number
        sends a packet there when ``rand < p * 2**32``; everything else goes to 1:10 (no practical limit)."""
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {probability}")
        self.clear(ns, dev)
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        self._tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
        self._tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "100gbit")
        self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
        threshold = min(int(probability * 2**32), 2**32 - 1)
        if probability >= 1.0:  # every packet: match-all
            prog = "2,6 0 0 4294967295,6 0 0 4294967295"
        else:  # A = rand; if A >= threshold: no match (ret 0) else: match (ret -1 -> classid)
            prog = f"4,32 0 0 {0xFFFFF000 + 56},53 0 1 {threshold},6 0 0 0,6 0 0 4294967295"
        for prio, proto in enumerate(("ip", "arp"), start=1):
            if proto == "arp" and probability < 1.0:
                continue  # random loss: keep neighbour resolution working, as on a lossy wire after ARP
            self._tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", proto, "prio", str(prio),
                     "bpf", "bytecode", prog, "classid", "1:20")

    def blackhole(self, ns: str, dev: str, on: bool = True) -> None:
        """Drop every egress packet of ``dev`` (the link looks cut to TCP, the interface stays up). One atomic
        ``tc qdisc replace`` by a zero-length FIFO: no moment without a qdisc in between (a shaper removed
        first would let the rest of a transfer through at full speed)."""
        if on:
            self._tc(ns, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")
        else:
            self.clear(ns, dev)

    def set_link_up(self, ns: str, dev: str, up: bool) -> None:
        """``ip link set <dev> up|down`` (the peer end sees carrier loss too)."""
        _run(["ip", "-n", ns, "link", "set", dev, "up" if up else "down"])

    def counters(self, ns: str, dev: str) -> dict[str, int]:
        """rx/tx bytes and packets of ``dev`` in ``ns`` (the evidence that traffic crossed the veth)."""
        out = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"]),
                "rx_packets": int(stats["rx"]["packets"]), "tx_packets": int(stats["tx"]["packets"]),
                "tx_dropped": int(stats["tx"].get("dropped", 0))}

    def qdisc_stats(self, ns: str, dev: str) -> list[dict[str, object]]:
        out = self._tc(ns, "-s", "-j", "qdisc", "show", "dev", dev).stdout
        return json.loads(out or "[]")

    # ---- running ----
    @staticmethod
    def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``ns`` (``ip netns exec`` also gives it a matching /sys)."""
        return ["ip", "netns", "exec", ns, *argv]

    # ---- teardown ----
    def destroy(self) -> None:
        """Delete every namespace of this topology (idempotent; continues past errors, logs them)."""
        while self.wires:
            self.wires.pop().stop()
        while self.namespaces:
            ns = self.namespaces.pop()
            res = _run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0 and os.path.exists(os.path.join(_NETNS_DIR, ns)):
                logger.warning("could not delete namespace %s: %s", ns, res.stderr.strip())
        self.links.clear()


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(_NETNS_DIR))
    except FileNotFoundError:
        return []


def cleanup_stale() -> list[str]:
    """Delete ``lynx<pid>x...`` namespaces whose creating process no longer exists, killing the processes still
    running in them first (servers a SIGKILLed launcher left: deleting the name alone leaves them serving in an
    anonymous namespace); returns their names."""
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        for orphan in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(orphan), signal.SIGKILL)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    if removed:
        logger.info("removed stale namespaces %s", removed)
    return removed


_libc = None
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _setns(fd: int) -> None:
    _check(_c().setns(fd, _CLONE_NEWNET), "setns")


def enter_process(ns: str) -> None:
    """Move THIS (single-threaded, freshly started) process into ``ns`` the way ``ip netns exec`` does: join
    the network namespace, then a private mount namespace with the namespace's own /sys mounted, so tools that
    list interfaces through /sys/class/net (UCX does) see the namespace's devices. Call it first thing in a
    spawned child, before anything opens sockets or starts threads."""
    fd = os.open(os.path.join(_NETNS_DIR, ns), os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)
    libc = _c()
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")  # no propagation out
    libc.umount2(b"/sys", _MNT_DETACH)
    _check(libc.mount(ns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the body with the CALLING THREAD inside namespace ``ns`` (sockets it opens, processes it forks or
    spawns belong there), then return it to its previous namespace. Other threads are not affected; a thread
    started in the body stays in ``ns``."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(_NETNS_DIR, ns), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


_TUNSETIFF, _IFF_TAP, _IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Wire(threading.Thread):
    """Copies Ethernet frames between two TAP file descriptors, each one ``delay_s`` after it was read (order
    kept per direction). Closing the TAP fds in :meth:`stop` removes the devices."""

    def __init__(self, fd_a: int, fd_b: int, delay_s: float, mtu: int) -> None:
        super().__init__(name="lynx-wire", daemon=True)
        self._fds = (fd_a, fd_b)
        self.delay_s = delay_s
        self._bufsize = mtu + 64
        self._wake_r, self._wake_w = os.pipe()
        self._stop_flag = False
        self.frames = 0

    def run(self) -> None:
        a, b = self._fds
        other = {a: b, b: a}
        queue: list[tuple[float, int, int, bytes]] = []
        seq = itertools.count()
        while not self._stop_flag:
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, fd, frame = heapq.heappop(queue)
                with contextlib.suppress(OSError):  # device gone or queue full: the frame is lost, as on a wire
                    os.write(fd, frame)
            timeout = None if not queue else max(0.0, queue[0][0] - now)
            ready, _, _ = select.select([a, b, self._wake_r], [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                if fd == self._wake_r:
                    continue
                for _ in range(64):
                    try:
                        frame = os.read(fd, self._bufsize)
                    except BlockingIOError:
                        break
                    except OSError:
                        return
                    self.frames += 1
                    heapq.heappush(queue, (now + self.delay_s, next(seq), other[fd], frame))

    def stop(self) -> None:
        self._stop_flag = True
        os.write(self._wake_w, b"x")
        self.join(5)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
