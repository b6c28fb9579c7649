"""The reference line for TCP runs: what plain sockets carry between the same ranks.

On one host the benchmark prints memcpy as the ceiling. Over TCP the ceiling is the
link: :func:`tcp_ring_bandwidth` measures it in the same run, between the same
processes and addresses pycomm uses, in the ring's pattern. Each rank sends to the
next rank and receives from the previous, both at once, which is what a ring all-reduce
asks of every link, over as many streams per peer and I/O threads as the pycomm group
uses (PYCOMM_SOCKETS_PER_PEER, PYCOMM_IO_THREADS): a reference of one stream would
understate a link that one stream cannot fill. The slowest rank's receive rate is the
reference for busbw: a ring all-reduce moves busbw = algbw * 2(n-1)/n bytes per
second over each rank's link, so busbw / this rate is the share of the link used.

The sender uses sendfile(2) from an in-memory file: the kernel takes the pages without
a copy from user memory, so the line is the link's limit at the least CPU per byte.
PYCOMM_BENCH_LINK_SEND=copy sends with send(2) from a user buffer instead, the copy
any library sending a tensor makes (what pycomm's I/O threads do): the two lines
bracket what a send(2)-based library can reach on a link its copies can saturate.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from .._control import all_gather_json
from .config import PREFIX

__all__ = ["tcp_ring_bandwidth", "LINK_SECONDS"]

LINK_SECONDS = 1.0  # how long each rank sends
_CHUNK = 4 << 20  # bytes per receive call
_FILE_BYTES = 16 << 20  # bytes per sendfile pass
_SETUP_TIMEOUT_S = 30.0


def _listen(address: str, backlog: int = 1) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, 0))
    server.listen(backlog)
    server.settimeout(_SETUP_TIMEOUT_S)
    return server


def _send_mode() -> str:
    mode = os.environ.get("PYCOMM_BENCH_LINK_SEND", "sendfile")
    if mode not in ("sendfile", "copy"):
        raise ValueError(f"{PREFIX} PYCOMM_BENCH_LINK_SEND must be sendfile or copy (got {mode!r})")
    return mode


def _pump(outgoing: Sequence[socket.socket], incoming: Sequence[socket.socket],
          seconds: float) -> Tuple[float, Optional[float], Optional[float]]:
    """One thread, both directions at once, as one of pycomm's I/O threads does: send on
    every ``outgoing`` socket for ``seconds`` (sendfile(2) from an in-memory file, or
    send(2) from a buffer with PYCOMM_BENCH_LINK_SEND=copy) while receiving on every
    ``incoming`` one until its peer's stream ends. Returns (bytes received, perf_counter of the first received byte, of the last
    stream's end); the times are None when nothing arrived."""
    copy = _send_mode() == "copy"
    fd = None if copy else os.memfd_create("pycomm-link")
    if fd is not None:
        os.ftruncate(fd, _FILE_BYTES)
    source = memoryview(bytearray(_FILE_BYTES)) if copy else None
    buffer = bytearray(_CHUNK)
    selector = selectors.DefaultSelector()
    offsets = {}
    for sock in outgoing:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_WRITE, "out")
        offsets[sock] = 0
    for sock in incoming:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, "in")
    total, first, end = 0, None, None
    sending, receiving = len(outgoing), len(incoming)
    send_until = time.monotonic() + seconds
    give_up = send_until + _SETUP_TIMEOUT_S
    try:
        while receiving or sending:
            if time.monotonic() > give_up:
                raise RuntimeError(f"{PREFIX} the raw TCP reference did not finish in "
                                   f"{seconds + _SETUP_TIMEOUT_S:.0f} s")
            for key, _ in selector.select(timeout=1.0):
                sock = key.fileobj
                if key.data == "out":
                    if time.monotonic() >= send_until:
                        sock.shutdown(socket.SHUT_WR)
                        selector.unregister(sock)
                        sending -= 1
                        continue
                    try:
                        if copy:
                            offsets[sock] += sock.send(source[offsets[sock]:])
                        else:
                            offsets[sock] += os.sendfile(sock.fileno(), fd, offsets[sock],
                                                         _FILE_BYTES - offsets[sock])
                    except BlockingIOError:
                        pass
                    if offsets[sock] >= _FILE_BYTES:
                        offsets[sock] = 0
                    continue
                try:
                    n = sock.recv_into(buffer)
                except BlockingIOError:
                    continue
                if n == 0:
                    selector.unregister(sock)
                    receiving -= 1
                    end = time.perf_counter()
                    continue
                if first is None:
                    first = time.perf_counter()
                total += n
    finally:
        selector.close()
        if fd is not None:
            os.close(fd)
    return float(total), first, end


def _pump_threads(outgoing: List[socket.socket], incoming: List[socket.socket], seconds: float,
                  threads: int) -> Tuple[float, float]:
    """Stream i's pair (outgoing[i], incoming[i]) goes to thread i % threads, as pycomm
    spreads its streams over its I/O threads. Returns (bytes received by all, seconds
    from the first byte any stream received to the end of the last)."""
    threads = max(1, min(threads, len(outgoing)))
    results: List[object] = [None] * threads

    def work(t: int) -> None:
        try:
            results[t] = _pump(outgoing[t::threads], incoming[t::threads], seconds)
        except BaseException as exc:  # re-raised on the calling thread
            results[t] = exc

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(1, threads)]
    for worker in workers:
        worker.start()
    work(0)
    for worker in workers:
        worker.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    total = sum(r[0] for r in results)
    firsts = [r[1] for r in results if r[1] is not None]
    ends = [r[2] for r in results if r[2] is not None]
    if not firsts or not ends:
        return total, 0.0
    return total, max(ends) - min(firsts)


def tcp_ring_bandwidth(group, rank: int, world_size: int, address: str,
                       seconds: float = LINK_SECONDS, streams: int = 1,
                       threads: int = 1) -> Tuple[float, List[float]]:
    """GB/s each rank received while sending at the same time, in the ring pattern
    (rank r sends to r+1 and receives from r-1) over ``streams`` TCP connections each
    way, pumped by ``threads`` threads, for ``seconds``. Returns (the slowest rank's
    rate, every rank's rate). ``group`` is a gloo group of the same ranks (the
    addresses travel through it); ``address`` is the local address to listen on (the
    one pycomm listens on). One rank: (0.0, [0.0])."""
    if world_size < 2:
        return 0.0, [0.0]
    if streams < 1 or threads < 1:
        raise ValueError(f"{PREFIX} the raw TCP reference needs streams >= 1 and threads >= 1 "
                         f"(got {streams}, {threads})")
    server = _listen(address, streams)
    addrs = all_gather_json(list(server.getsockname()), group=group)
    outgoing: List[socket.socket] = []
    incoming: List[socket.socket] = []
    try:
        for _ in range(streams):
            outgoing.append(socket.create_connection(tuple(addrs[(rank + 1) % world_size]),
                                                     timeout=_SETUP_TIMEOUT_S))
        for _ in range(streams):
            incoming.append(server.accept()[0])
        server.close()
        for sock in outgoing + incoming:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dist.barrier(group=group)
        received, elapsed = _pump_threads(outgoing, incoming, seconds, threads)
    finally:
        server.close()
        for sock in outgoing + incoming:
            sock.close()
    rate = received / elapsed / 1e9 if elapsed > 0 else 0.0
    rates = all_gather_json(rate, group=group)
    return min(rates), [float(r) for r in rates]
