"""How many TCP streams (sockets per peer) and I/O threads a link needs.

One TCP stream driven by one I/O thread moves at most ``per_stream`` bytes per
second on a host (what ``python -m pycomm.plan --calibrate`` measures over
loopback with one socket per peer: the copy and syscall cost of one thread, not
the wire). A link of bandwidth ``B`` reached with ``s`` streams then moves

    min(B, s * per_stream)

so ``auto`` takes the fewest streams that fill the link, s = ceil(B / per_stream)
(1..16), and as many I/O threads, up to half this host's CPUs (each stream's
thread is the unit that reaches per_stream). Where the link's speed is unknown
(loopback, a virtual interface without a speed) or nothing was measured, one
stream and one thread, as before. NCCL's NCCL_NSOCKS_PERTHREAD and
NCCL_SOCKET_NTHREADS are the same two knobs, chosen by hand there.

Torch-free and pycomm._C-free: pycomm.config and pycomm.plan use it.
"""
from __future__ import annotations

import math
import os
import socket
import struct
from typing import Optional, Tuple

__all__ = ["MAX_STREAMS", "MAX_IO_THREADS", "link_gbps", "stream_gbps", "choose_streams"]

MAX_STREAMS = 16      # csrc/transport/wire.h kMaxStreams
MAX_IO_THREADS = 16   # csrc/transport/tcp.h kMaxIoThreads


def _interface_of(address: str) -> Optional[str]:
    """The interface that holds IPv4 ``address`` (None if none does)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    import fcntl
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def link_gbps(address: str, sys_class_net: str = "/sys/class/net") -> Optional[float]:
    """The speed (Gbit/s) of the interface holding ``address``, from the kernel
    (/sys/class/net/IF/speed, Mbit/s); None for loopback, an unknown speed, or a
    virtual interface (no /sys/class/net/IF/device: veth, bridge, tun), whose
    reported speed is a constant (a veth says 10000) rather than a link's."""
    if not address or address.startswith("127."):
        return None
    name = _interface_of(address)
    if name is None or not os.path.exists(os.path.join(sys_class_net, name, "device")):
        return None
    try:
        with open(os.path.join(sys_class_net, name, "speed")) as handle:
            mbit = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return mbit / 1000.0 if mbit > 0 else None


def stream_gbps(s: int, link: Optional[float], per_stream: Optional[float]) -> Optional[float]:
    """What ``s`` streams move over a link of ``link`` Gbit/s: min(link, s * per_stream)."""
    if per_stream is None:
        return link
    return s * per_stream if link is None else min(link, s * per_stream)


def choose_streams(link: Optional[float], per_stream: Optional[float],
                   cpus: Optional[int] = None) -> Tuple[int, int]:
    """(sockets per peer, I/O threads) for a link of ``link`` Gbit/s when one stream
    moves ``per_stream`` Gbit/s: the fewest streams that fill the link (1 when either
    is unknown), and one thread per stream up to half the CPUs."""
    if not link or not per_stream or per_stream <= 0:
        return 1, 1
    streams = max(1, min(MAX_STREAMS, math.ceil(link / per_stream - 1e-9)))
    cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                          else os.cpu_count() or 1)
    threads = max(1, min(streams, MAX_IO_THREADS, cpus // 2))
    return streams, threads
