"""lynx_connector.lab.netns itself: namespaces and links appear and disappear (also after a failure half-way), tc
shaping and loss do what they say, `entered` returns the thread to its namespace, stale namespaces are swept.
Plain sockets only (no NIXL): a few seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from lynx_connector.lab import netns

_ok, _why = netns.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces: {_why}"),
              pytest.mark.timeout(120)]


def _netns_inode() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def test_topology_created_and_destroyed_even_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Topology() as topo:
            p, d = topo.add_namespace("p"), topo.add_namespace("d")
            link = topo.add_link(p, d)
            assert {p, d} <= set(netns.list_namespaces())
            assert (link.addr_a, link.addr_b) == netns.Topology.link_addrs(1) == ("10.213.1.1", "10.213.1.2")
            assert link.end(d) == ("to-p", "10.213.1.2") and link.peer_addr(p) == "10.213.1.2"
            raise RuntimeError("boom")
    assert not {p, d} & set(netns.list_namespaces())


def test_bad_input_rejected_and_nothing_leaks() -> None:
    with netns.Topology() as topo:
        p = topo.add_namespace("p")
        with pytest.raises(ValueError):
            topo.add_namespace("Bad_Role")
        with pytest.raises(ValueError):
            topo.add_link(p, "not-mine")
        with pytest.raises(netns.NetnsError):
            topo.shape(p, "no-such-dev", 100)
        with pytest.raises(ValueError):
            topo.set_loss(p, "lo", 0.0)
    assert p not in netns.list_namespaces()


def test_entered_switches_only_the_calling_thread_and_returns() -> None:
    root = _netns_inode()
    seen: dict[str, int] = {}
    with netns.Topology() as topo:
        p = topo.add_namespace("p")
        with netns.entered(p):
            inside = _netns_inode()
            t = threading.Thread(target=lambda: seen.setdefault("other", _netns_inode()))
            t.start()
            t.join()
        assert _netns_inode() == root and inside != root
        assert seen["other"] == inside  # a thread started inside stays inside
    assert _netns_inode() == root


def _serve_and_send(topo: netns.Topology, link: netns.Link, nbytes: int) -> float:
    """Receiver in ns b, sender in ns a (threads that entered the namespaces); seconds to deliver nbytes."""
    with netns.entered(link.ns_b):
        srv = socket.create_server((link.addr_b, 0))
    port, got = srv.getsockname()[1], {}

    def recv() -> None:
        conn, _ = srv.accept()
        n = 0
        while chunk := conn.recv(1 << 20):
            n += len(chunk)
        got["n"], got["t"] = n, time.monotonic()
        conn.close()

    rt = threading.Thread(target=recv)
    rt.start()
    with netns.entered(link.ns_a):
        cli = socket.create_connection((link.addr_b, port), timeout=30)
    t0 = time.monotonic()
    cli.sendall(b"\0" * nbytes)
    cli.close()
    rt.join(60)
    srv.close()
    assert got.get("n") == nbytes
    return got["t"] - t0


def _udp_loss(link: netns.Link, n: int) -> float:
    with netns.entered(link.ns_b):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind((link.addr_b, 0))
    with netns.entered(link.ns_a):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.settimeout(0.5)
    got = 0
    try:
        for i in range(n):
            tx.sendto(b"\0" * 1000, rx.getsockname())
            if i % 50 == 49:  # let the receiver drain: only the qdisc may lose datagrams
                time.sleep(0.002)
                while True:
                    try:
                        rx.recv(2048, socket.MSG_DONTWAIT)
                        got += 1
                    except (BlockingIOError, TimeoutError):
                        break
        while True:
            try:
                rx.recv(2048)
                got += 1
            except TimeoutError:
                break
    finally:
        rx.close()
        tx.close()
    return 1.0 - got / n


def test_tbf_rate_and_random_loss_on_a_real_link() -> None:
    with netns.Topology() as topo:
        p, d = topo.add_namespace("p"), topo.add_namespace("d")
        link = topo.add_link(p, d)
        topo.shape(p, link.dev_a, 80)  # 10 MB/s
        secs = _serve_and_send(topo, link, 5_000_000)
        assert 0.4 <= secs <= 1.0, secs  # ~0.5 s at 10 MB/s (TCP ramp-up and the box's load on top)
        topo.set_loss(p, link.dev_a, 0.05)
        _serve_and_send(topo, link, 2_000_000)  # TCP retransmits: all bytes still arrive
        lost = _udp_loss(link, 2000)  # UDP datagrams (no GSO, no retransmits) measure the probability
        assert 0.025 <= lost <= 0.085, lost
        topo.blackhole(p, link.dev_a)
        with netns.entered(p), pytest.raises(OSError):
            socket.create_connection((link.addr_b, 9), timeout=1.0)
        topo.blackhole(p, link.dev_a, on=False)


def test_cleanup_stale_removes_namespaces_of_dead_creators() -> None:
    code = ("from lynx_connector.lab import netns; t = netns.Topology(); print(t.add_namespace('z'))")
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip().splitlines()[-1]
    assert name in netns.list_namespaces()  # its creator exited without destroy()
    # a server the dead creator left running in it (a SIGKILLed launcher's): killed, not left in an anonymous one
    orphan = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", "import time; time.sleep(600)"],
                              start_new_session=True)
    deadline = time.monotonic() + 30
    while str(orphan.pid) not in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                                text=True).stdout.split() and time.monotonic() < deadline:
        time.sleep(0.05)
    removed = netns.cleanup_stale()
    assert name in removed and name not in netns.list_namespaces()
    assert orphan.wait(10) == -signal.SIGKILL
