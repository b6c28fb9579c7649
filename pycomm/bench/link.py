"""The reference line for TCP runs: what plain sockets carry between the same ranks.

On one host the benchmark prints memcpy as the ceiling. Over TCP the ceiling is the
link: :func:`tcp_ring_bandwidth` measures it in the same run, between the same
processes and addresses pycomm uses, in the ring's pattern. Each rank sends one
stream to the next rank and receives one from the previous, both at once, which is
what a ring all-reduce asks of every link. The slowest rank's receive rate is the
reference for busbw: a ring all-reduce moves busbw = algbw * 2(n-1)/n bytes per
second over each rank's link, so busbw / this rate is the share of the link used.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from typing import List, Tuple

import torch.distributed as dist

from .sweep import PREFIX

__all__ = ["tcp_ring_bandwidth", "LINK_SECONDS"]

LINK_SECONDS = 1.0  # how long each rank sends
_CHUNK = 4 << 20  # bytes per receive call
_FILE_BYTES = 16 << 20  # bytes per sendfile pass
_SETUP_TIMEOUT_S = 30.0


def _listen(address: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, 0))
    server.listen(1)
    server.settimeout(_SETUP_TIMEOUT_S)
    return server


def _pump(outgoing: socket.socket, incoming: socket.socket, seconds: float) -> Tuple[float, float]:
    """One thread, both directions at once, as pycomm's I/O thread does: send for
    ``seconds`` (sendfile(2) from an in-memory file, the kernel copies) while receiving
    until the peer's stream ends. Returns (bytes received, seconds from the first
    received byte to the end)."""
    fd = os.memfd_create("pycomm-link")
    os.ftruncate(fd, _FILE_BYTES)
    buffer = bytearray(_CHUNK)
    outgoing.setblocking(False)
    incoming.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(outgoing, selectors.EVENT_WRITE, "out")
    selector.register(incoming, selectors.EVENT_READ, "in")
    total, first, end, offset = 0, None, None, 0
    sending, receiving = True, True
    send_until = time.monotonic() + seconds
    give_up = send_until + _SETUP_TIMEOUT_S
    try:
        while receiving or sending:
            if time.monotonic() > give_up:
                raise RuntimeError(f"{PREFIX} the raw TCP reference did not finish in "
                                   f"{seconds + _SETUP_TIMEOUT_S:.0f} s")
            for key, _ in selector.select(timeout=1.0):
                if key.data == "out":
                    if time.monotonic() >= send_until:
                        outgoing.shutdown(socket.SHUT_WR)
                        selector.unregister(outgoing)
                        sending = False
                        continue
                    try:
                        offset += os.sendfile(outgoing.fileno(), fd, offset, _FILE_BYTES - offset)
                    except BlockingIOError:
                        pass
                    if offset >= _FILE_BYTES:
                        offset = 0
                    continue
                try:
                    n = incoming.recv_into(buffer)
                except BlockingIOError:
                    continue
                if n == 0:
                    selector.unregister(incoming)
                    receiving = False
                    end = time.perf_counter()
                    continue
                if first is None:
                    first = time.perf_counter()
                total += n
    finally:
        selector.close()
        os.close(fd)
    return float(total), (end - first) if first is not None and end is not None else 0.0


def tcp_ring_bandwidth(group, rank: int, world_size: int, address: str,
                       seconds: float = LINK_SECONDS) -> Tuple[float, List[float]]:
    """GB/s each rank received while sending at the same time, in the ring pattern
    (rank r sends to r+1 and receives from r-1), over ``seconds``. Returns (the slowest
    rank's rate, every rank's rate). ``group`` is a gloo group of the same ranks (the
    addresses travel through it); ``address`` is the local address to listen on (the
    one pycomm listens on). One rank: (0.0, [0.0])."""
    if world_size < 2:
        return 0.0, [0.0]
    server = _listen(address)
    addrs: List[object] = [None] * world_size
    dist.all_gather_object(addrs, server.getsockname(), group=group)
    outgoing = socket.create_connection(tuple(addrs[(rank + 1) % world_size]), timeout=_SETUP_TIMEOUT_S)
    incoming, _ = server.accept()
    server.close()
    for sock in (outgoing, incoming):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dist.barrier(group=group)
    try:
        received, elapsed = _pump(outgoing, incoming, seconds)
    finally:
        outgoing.close()
        incoming.close()
    rate = received / elapsed / 1e9 if elapsed > 0 else 0.0
    rates: List[object] = [None] * world_size
    dist.all_gather_object(rates, rate, group=group)
    return min(rates), [float(r) for r in rates]
