"""Every PYCOMM_* environment knob, read in one place.

=====================  =========  ==================================================
variable               default    meaning
=====================  =========  ==================================================
PYCOMM_ALGO            auto       all-reduce algorithm: auto, ring, tree, sharded or
                                  shm (auto takes shm when every rank of the group
                                  shares a host, else the cost model's choice)
PYCOMM_TRANSPORT       auto       auto: shared memory among ranks on one host (same
                                  hostname, boot id and namespaces), TCP between
                                  hosts; shm: the same, and a failure to set up
                                  shared memory is an error; tcp: TCP only
PYCOMM_SEGMENT_BYTES   262144     pipeline segment size in bytes
PYCOMM_SOCKET_IFNAME   (unset)    network interface to listen on (e.g. eth0)
PYCOMM_CHECK           0          1 makes ranks compare each collective's call (op,
                                  dtype, element count, reduce op, root) before
                                  running it, so a mismatch fails with an error
                                  naming the ranks; also on with
                                  TORCH_DISTRIBUTED_DEBUG=DETAIL. Costs one small
                                  all-gather per collective.
PYCOMM_DEBUG           0          1 prints the algorithm chosen per all-reduce,
                                  dropped connections and failures to stderr (read
                                  by the C++ core)
PYCOMM_BUILD_CUDA      auto       build time only, read by setup.py (not here):
                                  auto / 0 / 1 = CUDA sources when available /
                                  never / required
=====================  =========  ==================================================

Without PYCOMM_SOCKET_IFNAME, pycomm listens on the local address that routes to
the rendezvous host (MASTER_ADDR or the TCPStore's host), falling back to the
host name's address, then to 127.0.0.1.
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import struct

__all__ = ["Config", "load_config", "bind_address", "ENV_VARS"]

ENV_VARS = ("PYCOMM_ALGO", "PYCOMM_TRANSPORT", "PYCOMM_SEGMENT_BYTES", "PYCOMM_SOCKET_IFNAME", "PYCOMM_CHECK", "PYCOMM_DEBUG")
ALGORITHMS = ("auto", "ring", "tree", "sharded", "shm")
TRANSPORTS = ("auto", "shm", "tcp")


@dataclasses.dataclass(frozen=True)
class Config:
    algorithm: str = "auto"
    segment_bytes: int = 256 * 1024
    socket_ifname: str | None = None
    check_calls: bool = False
    transport: str = "auto"


def load_config(environ=None) -> Config:
    env = os.environ if environ is None else environ
    algorithm = env.get("PYCOMM_ALGO", "auto").strip().lower() or "auto"
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"pycomm: PYCOMM_ALGO={algorithm!r} is not one of {', '.join(ALGORITHMS)}"
        )
    raw_segment = env.get("PYCOMM_SEGMENT_BYTES", "262144")
    try:
        segment = int(raw_segment)
    except ValueError:
        raise ValueError(f"pycomm: PYCOMM_SEGMENT_BYTES={raw_segment!r} is not an integer") from None
    if segment < 64:
        raise ValueError(f"pycomm: PYCOMM_SEGMENT_BYTES={segment} is too small (minimum 64)")
    transport = env.get("PYCOMM_TRANSPORT", "auto").strip().lower() or "auto"
    if transport not in TRANSPORTS:
        raise ValueError(
            f"pycomm: PYCOMM_TRANSPORT={transport!r} is not one of {', '.join(TRANSPORTS)}"
        )
    ifname = env.get("PYCOMM_SOCKET_IFNAME") or None
    check = env.get("PYCOMM_CHECK", "0").strip() not in ("", "0") or (
        env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
    )
    return Config(algorithm=algorithm, segment_bytes=segment, socket_ifname=ifname, check_calls=check,
                  transport=transport)


def _interface_address(ifname: str) -> str:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise ValueError(
                f"pycomm: PYCOMM_SOCKET_IFNAME={ifname!r}: no IPv4 address on that interface ({exc})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str | None:
    """The local address the kernel would use to reach `host`."""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))  # UDP connect sends nothing
            return sock.getsockname()[0]
        except OSError:
            return None


def _store_host(store) -> str | None:
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def bind_address(config: Config, store=None) -> str:
    if config.socket_ifname:
        return _interface_address(config.socket_ifname)
    for host in (os.environ.get("MASTER_ADDR"), _store_host(store)):
        if host:
            address = _route_to(host)
            if address:
                return address
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return "127.0.0.1"
