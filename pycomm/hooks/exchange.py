"""hosts=...: the hierarchical exchange of the compressed hooks (a sum on each host's
leader, the leaders' compressed all-reduce, a broadcast inside each host)."""
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .._control import all_gather_json
from ._common import _future_tensor, _group_size, _is_pycomm, _pycomm_backend

def _host_key() -> str:
    """This process's host as pycomm's transport tells hosts apart (shm_segment.cc
    hostKey): hostname, boot id, and the network, IPC, mount and PID namespaces."""
    import os
    import socket

    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.readline().strip())
    except OSError:
        parts.append("?")
    for name in ("net", "ipc", "mnt", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{name}"))
        except OSError:
            parts.append("?")
    return "|".join(parts)


def _hosts_config(hosts):
    return hosts if isinstance(hosts, (str, type(None))) else [list(h) for h in hosts]


class _HostGroups:
    """TopKState(hosts=...): this rank's host, its leader and the groups the hierarchical
    exchange runs on. Two groups per host, one for the sum towards the leader and one
    for the leader's broadcast: the leader starts a bucket's broadcast only when the
    leaders' sparse all-reduce is done, by which time it may have started later
    buckets' sums; on one group the ranks' calls would pair up out of order."""

    def __init__(self, layout: List[List[int]], rank: int, world: int, backend: str):
        import threading

        self.layout = layout
        self.host = next(h for h, ranks in enumerate(layout) if rank in ranks)
        self.leader = layout[self.host][0]  # group rank (the state's group is the default group)
        self.is_leader = rank == self.leader
        self.world = world
        # new_group is collective over the default group: every rank creates every group,
        # in the same order.
        self.sum_group = self.bcast_group = self.leaders = None
        for h, ranks in enumerate(layout):
            sum_group = dist.new_group(ranks, backend=backend)
            bcast_group = dist.new_group(ranks, backend=backend)
            if h == self.host:
                self.sum_group, self.bcast_group = sum_group, bcast_group
        leaders = dist.new_group([ranks[0] for ranks in layout], backend=backend)
        if self.is_leader:
            self.leaders = leaders
        self.lock = threading.RLock()  # a stage that fails registers the bucket's later stages
        self.tickets = 0  # buckets started: the leader starts their sparse all-reduces and
        # broadcasts in this order, whichever thread gets to a bucket first
        self.next = {"sparse": 0, "broadcast": 0}
        self.ready: Dict[str, Dict[int, Callable[[], None]]] = {"sparse": {}, "broadcast": {}}

    @staticmethod
    def build(process_group, hosts, op: str) -> Optional["_HostGroups"]:
        """The groups for ``hosts`` (None: none, the flat exchange)."""
        if hosts is None:
            return None
        if not dist.is_initialized():
            raise ValueError(f"pycomm {op}: hosts needs an initialised default process group "
                             "(create the state after dist.init_process_group)")
        world = _group_size(process_group)
        if world != dist.get_world_size():
            raise ValueError(f"pycomm {op}: hosts needs the state's group to be the whole default group "
                             f"(it has {world} of {dist.get_world_size()} ranks)")
        if not _is_pycomm(process_group):
            raise ValueError(f"pycomm {op}: hosts needs a pycomm process group (its compressed all-reduce)")
        rank = dist.get_rank(process_group)
        if hosts == "auto":
            keys = all_gather_json(_host_key(), group=process_group)
            order: Dict[str, List[int]] = {}
            for r, key in enumerate(keys):
                order.setdefault(key, []).append(r)
            layout = list(order.values())
        elif isinstance(hosts, (list, tuple)):
            layout = [sorted(int(r) for r in ranks) for ranks in hosts]
            flat = sorted(r for ranks in layout for r in ranks)
            if flat != list(range(world)) or any(not ranks for ranks in layout):
                raise ValueError(f"pycomm {op}: hosts must list every rank of the group once, in "
                                 f"non-empty lists (got {hosts!r} for {world} ranks)")
            layout.sort(key=lambda ranks: ranks[0])
        else:
            raise ValueError(f"pycomm {op}: hosts must be None, 'auto' or lists of ranks (got {hosts!r})")
        if len(layout) in (1, world):
            return None  # one host, or one rank per host: the flat exchange is the same thing
        return _HostGroups(layout, rank, world, dist.get_backend(process_group))

    def in_order(self, stage: str, ticket: int, start: Callable[[], None]) -> None:
        """Runs the leader's ``stage`` ("sparse" / "broadcast") of bucket ``ticket`` once
        that of every earlier bucket has run: collectives must start in the same order on
        every rank, and a bucket's sum can complete (and its callback run, on a completion
        thread or inline on DDP's) before an earlier bucket's callback has started."""
        with self.lock:
            self.ready[stage][ticket] = start
            while self.next[stage] in self.ready[stage]:
                fn = self.ready[stage].pop(self.next[stage])
                self.next[stage] += 1
                fn()  # under the lock: one bucket at a time, in bucket order


def _hosts_exchange(state, buffer: torch.Tensor, world: int, step: int, segments, exchange):
    """``hosts=...``: the bucket summed on the host's leader, the leaders' compressed
    all-reduce of their hosts' sums (``exchange``: _topk_pycomm or _quantize_pycomm, on the
    leaders' group, divided by the whole world), the result broadcast inside each host."""
    h = state._hosts
    with h.lock:
        ticket = h.tickets
        h.tickets += 1
    leader = h.leader
    if not h.is_leader:
        # A copy goes to the sum: the broadcast, on another group, writes into the buffer.
        sent = buffer.clone()
        dist.reduce(sent, dst=leader, group=h.sum_group, async_op=True)
        fut = dist.broadcast(buffer, src=leader, group=h.bcast_group, async_op=True).get_future()
        return fut.then(lambda f: _future_tensor(f))
    result: torch.futures.Future = torch.futures.Future()
    summed = dist.reduce(buffer, dst=leader, group=h.sum_group, async_op=True).get_future()
    failed: List[BaseException] = []
    registered = set()  # this bucket's stages handed to h.in_order

    def advance(stage: str, start: Callable[[], None]) -> None:
        registered.add(stage)
        h.in_order(stage, ticket, start)

    def fail(error: BaseException) -> None:
        # The host's other ranks wait in the broadcast: take its group down so they fail
        # too, rather than waiting for the timeout.
        backend = _pycomm_backend(h.bcast_group)
        if backend is not None:
            backend.abort()
        if not failed:
            failed.append(error)
        # later buckets' stages wait for this one's: let them go
        for stage in ("sparse", "broadcast"):
            if stage not in registered:
                advance(stage, lambda: None)
        if not result.done():
            result.set_result(None)  # re-raised by the .then below, as torch's callbacks raise

    def broadcast() -> None:
        try:
            done = dist.broadcast(buffer, src=leader, group=h.bcast_group, async_op=True).get_future()
        except Exception as e:  # noqa: BLE001  (the group was aborted by an earlier bucket's failure)
            fail(e)
            return

        def finish(f):
            try:
                f.value()
                result.set_result(buffer)
            except Exception as e:  # noqa: BLE001
                fail(e)
        done.add_done_callback(finish)

    def then_stage(fut: torch.futures.Future, stage: str, start: Callable[[], None]) -> None:
        """When ``fut`` completes: its error fails the bucket, else ``stage`` starts in order."""
        def done(f):
            try:
                f.value()
            except Exception as e:  # noqa: BLE001
                fail(e)
                return
            advance(stage, start)
        fut.add_done_callback(done)

    def sparse() -> None:
        try:
            averaged = exchange(_pycomm_backend(h.leaders), state, buffer, world, step, segments,
                                group=h.leaders)
        except Exception as e:  # noqa: BLE001
            fail(e)
            return
        then_stage(averaged, "broadcast", broadcast)

    then_stage(summed, "sparse", sparse)

    def value(f):
        if failed:
            raise failed[0]
        return buffer
    return result.then(value)
