"""Two-stream KV transport over NIXL: P stages each request as one contiguous anchor region and one residual
region in a registered pool; D pulls them with its own scheduler, ranked across requests by what unblocks
output (``ranking.py``).

    from lynx_connector.transport import TransportConfig, TransferSource, TransferSink
    cfg = TransportConfig(key=load_side_channel_key())  # the deployment key (None: insecure, tests only)
    src = TransferSource(cfg, compat)                 # P: st = src.alloc(req, a, r); encode into st.anchor /
                                                      #    st.residual; src.publish(req); src.poll() -> freed ids
                                                      #    tid, token = src.ticket(req): sent to D
    sink = TransferSink(cfg, compat)                  # D: v = sink.pool.alloc_request(req, a, r)
    sink.pull(req, host, port, tid, token, v.anchor, v.residual); sink.poll() -> [TransferEvent]

Settings chosen on the 2-core CPU box (NIXL 1.5.1 / UCX 1.23, measured; see ``lynx bench transfer``):
* NIXL progress thread OFF (``progress_thread=False``): with it on, each idle agent burned ~0.3 of a core
  here (reference runs: 100%); off, an idle sink used ~0.00% and an idle source ~0.03% of a core. Transfers
  still complete: D's service thread drives its agent (``transfer``/``check_xfer_state``), and P's service thread
  pumps its agent every ``target_progress_s`` (5 ms) only while published requests are live — needed for
  ``UCX_TLS=tcp`` (target-side progress), harmless with cma. Both threads block in ``zmq.Poller`` when idle.
* Priority by chunking (1 MiB chunks, ranked by ``ranking.py``), one agent, ``num_workers=1``: with cma,
  ``transfer()`` is synchronous (the READ happens inside the call), so the posting thread itself is the
  serialization point; a second UCX worker/agent would only help with a second posting thread. Measured: a new
  1 MiB anchor behind a 128 MiB residual being read completes in ~1-4 ms with 1 MiB chunks vs ~26-30 ms
  (i.e. after the residual) unchunked. The window (4 MiB) bounds bytes in flight when READs are asynchronous
  (``UCX_TLS=tcp``).
* Pacing: an emulated link on D (``link_gbps``, ``pacing.VirtualLink``): a chunk completes no sooner than its
  bytes' link time after the link freed, so N bytes take N / rate, never less; the next chunk is posted when
  the link frees, and a late wake-up of the posting thread (<= ``catch_up_s``, 20 ms) does not idle the link
  (5 ms lost up to half the rate at 25 Gb/s on the loaded box). Streams other than speculative anchors are held (<= ``anchor_holdoff_s``, 20 ms) while a
  speculative pull's regions are still being queried, so its anchor goes first.
"""

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import ANCHOR, RESIDUAL, TransferEvent
from lynx_connector.transport.keys import SideChannelKeyError, load_extra_keys, load_side_channel_key
from lynx_connector.transport.nixl_wrapper import NixlUnavailableError, NixlWrapper, nixl_available
from lynx_connector.transport.pool import StagedRequest, StagingAbandoned, StagingFullError, StagingPool
from lynx_connector.transport.protocol import ProtocolError, compat_hash
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

__all__ = [
    "ANCHOR",
    "RESIDUAL",
    "NixlUnavailableError",
    "NixlWrapper",
    "ProtocolError",
    "SideChannelKeyError",
    "StagedRequest",
    "StagingAbandoned",
    "StagingFullError",
    "StagingPool",
    "TransferEvent",
    "TransferSink",
    "TransferSource",
    "TransportConfig",
    "compat_hash",
    "load_extra_keys",
    "load_side_channel_key",
    "nixl_available",
]
