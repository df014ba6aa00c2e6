"""What a careless deployment exposes, said once at start-up.

:func:`exposure_warnings` names each exposure of a set of ``ServeOptions`` the manager starts
with anyway (it logs each as a WARNING): plaintext TCP beyond loopback
(``--allow-insecure-tcp``), the Prometheus endpoint beyond loopback, the vLLM-format ZMQ event
outlet on TCP beyond loopback (it has no authentication: a subscriber receives prompt token
ids), and operator calls open to every worker token (no ``--operator-token-file``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.service.server.manager import ServeOptions

__all__ = ["exposure_warnings"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _tcp_host(address: str) -> str | None:
    """The host of a ``host:port`` / ``tcp://host:port`` address (None: not TCP)."""
    if address.startswith(("unix:", "ipc:", "inproc:")):
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host = rest.rpartition(":")[0]
    return host or "*"


def exposure_warnings(o: ServeOptions) -> list[str]:
    """One sentence per exposure of the options ``o`` (a ``ServeOptions``)."""
    out = []
    host = _tcp_host(o.address)
    if host is not None and host not in _LOOPBACK and not o.tls_cert:
        out.append(f"plaintext TCP on {host!r} (--allow-insecure-tcp): anyone on the network can read the "
                   "auth token and every call")
    if o.metrics_port is not None and o.metrics_addr not in _LOOPBACK:
        out.append(f"the Prometheus endpoint listens on {o.metrics_addr!r}, beyond loopback, without authentication")
    if o.kv_events is not None:
        for ep in (o.kv_events.endpoint, o.kv_events.replay_endpoint):
            h = _tcp_host(ep) if ep else None
            if h is not None and h not in _LOOPBACK:
                out.append(f"the ZMQ event outlet listens on {ep!r}: it has no authentication and its events "
                           "carry prompt token ids; bind loopback or ipc://")
    if o.operator_token is None:
        out.append("no --operator-token-file: every worker token may Flush or Evict the shared tree and run "
                   "CheckInvariants")
    return out
