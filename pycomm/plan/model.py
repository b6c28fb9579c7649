"""The cost model: a topology, the C++ table's predictions (pycomm._C.allreduce_costs) and
the compressed all-reduces' formulas, with the units the command line reads."""

from __future__ import annotations

import math
import os
from typing import Dict, Optional, Tuple

from .. import _C
from ..config import COST_FIELDS

PREFIX = "pycomm plan:"
# The built-in constants (common/cost_model.h).
DEFAULT_MODEL: Dict[str, float] = {name: float(getattr(_C.CostModel(), name)) for name in COST_FIELDS}
DENSITIES = (0.01, 0.001)
BITS = (8, 4)
QUANT_BLOCK = 256
SIZES = tuple(1 << e for e in range(10, 31, 2))  # 1 KiB .. 1 GiB
DENSE = ("ring", "sharded", "tree")  # the network algorithms a compressed all-reduce competes with


class Topology:
    """hosts x ranks_per_host, with the link between hosts (None: this host's model).
    ``oversubscription``: ranks per CPU core on the most loaded machine (above 1 the
    CPU-bound terms scale by it); ``ingress_limited``: False where only each host's
    egress is limited (tc tbf in pycomm/netns.py), True for a real NIC."""

    def __init__(self, hosts: int, ranks_per_host: int, gbps: Optional[float] = None,
                 latency_s: Optional[float] = None, oversubscription: float = 1.0, ingress_limited: bool = True):
        if hosts < 1 or ranks_per_host < 1:
            raise ValueError(f"{PREFIX} hosts and ranks per host must be >= 1 (got {hosts} x {ranks_per_host})")
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        self.gbps, self.latency_s = gbps, latency_s
        self.oversubscription, self.ingress_limited = float(oversubscription), bool(ingress_limited)

    def shape(self) -> dict:
        """The keyword arguments of _C.allreduce_costs / _C._select_algorithm after the size."""
        return {"world_size": self.ranks, "one_host": self.hosts == 1,
                "hosts": self.hosts if self.hosts > 1 else 0, "oversubscription": self.oversubscription,
                "ingress_limited": self.ingress_limited}

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def model(self, base: Dict[str, float]) -> Dict[str, float]:
        """``base`` with the link's beta and alpha where given."""
        model = dict(base)
        if self.gbps:
            model["beta"] = 8.0 / (self.gbps * 1e9)
        if self.latency_s is not None:
            model["alpha"] = self.latency_s + base["alpha"]  # plus the per-message overhead
        return model

    def __str__(self) -> str:
        link = f", {self.gbps:g} Gbit/s" if self.gbps else ""
        link += f", {self.latency_s * 1e6:g} us" if self.latency_s is not None else ""
        return f"{self.hosts} host(s) x {self.ranks_per_host} rank(s){link}"


def _cost_object(model: Dict[str, float]):
    cost = _C.CostModel()
    for name in COST_FIELDS:
        setattr(cost, name, float(model.get(name, DEFAULT_MODEL[name])))
    return cost


def predict(model: Dict[str, float], topology: Topology, nbytes: int,
            codec: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """{algorithm: predicted seconds} for an all-reduce of ``nbytes`` per rank: every
    algorithm of the C++ table that fits, and with ``codec`` (encode + decode seconds
    per input byte, "topk" and "quantize") the compressed all-reduces ("topk d=0.01",
    "quantize 8-bit", ...)."""
    m = topology.model(model)
    out = dict(_C.allreduce_costs(int(nbytes), cost=_cost_object(m), **topology.shape()))
    if codec:
        out.update(_compressed(m, topology, nbytes, codec))
    return out


# TopKState's defaults: values travel as bfloat16, owners keep 2 x density (pycomm/hooks/topk.py).
TOPK_VALUE_BYTES = 2
TOPK_OWNER_FACTOR = 2.0
SPARSE_HEADER_BYTES = 16  # allreduce_sparse.cc: {format, nnz, payload_bytes}, one per message pair


def _gap_bytes(density: float) -> float:
    """Expected LEB128 length of the gap between consecutive kept positions when
    positions are kept independently with probability ``density`` (geometric gaps of
    mean 1/density): 1 byte, plus 1 for each of 2^7, 2^14, 2^21, 2^28 the gap reaches."""
    return 1.0 + sum((1.0 - density) ** (1 << (7 * k)) for k in (1, 2, 3, 4))


def topk_wire_bytes(nbytes: int, density: float, ranks: int, value_bytes: int = TOPK_VALUE_BYTES,
                    owner_factor: float = TOPK_OWNER_FACTOR, element_bytes: int = 4) -> float:
    """Bytes one rank sends in pycomm's sparse all-reduce (allreduce_sparse.cc) of a
    float32 buffer of ``nbytes`` from which every rank keeps ``density`` of the entries
    at independent random positions. Phase 1: its pairs in each other owner's 1/n of
    the buffer; phase 2: the ``owner_factor x density`` largest of its own 1/n's summed
    pairs (at most their union) to each of the n - 1 others. A pair is its gap's
    varint plus the value; each message is the smaller of that and the dense piece
    (value_bytes per element); a 16-byte header precedes every payload."""
    n = ranks
    if n < 2:
        return 0.0
    piece = nbytes / element_bytes / n  # elements an owner owns
    union = 1.0 - (1.0 - density) ** n
    kept = min(owner_factor * density, union)
    def message(d):
        return min(d * piece * (_gap_bytes(d) + value_bytes), piece * value_bytes) + SPARSE_HEADER_BYTES
    return (n - 1) * (message(density) + message(kept))


def _compressed(m: Dict[str, float], topology: Topology, nbytes: int, codec: Dict[str, float]) -> Dict[str, float]:
    """The compressed all-reduces as pycomm's hooks run them: two phases of direct
    exchanges with the other n - 1 ranks (every rank is an owner; messages in flight
    at once towards one rank cost delta each, as the sharded all-reduce's direct
    exchange: a top-k phase sends a header and a payload to each peer, a quantized
    phase one message), the bytes one rank sends (topk_wire_bytes; b-bit quantization
    sends b/32 of the buffer plus a float32 scale per block, 2 (n-1)/n of that), on a
    link its host's L ranks share, plus the hook's own work per input byte (codec).
    With L > 1 ranks on each of several hosts, also the hosts=... variants: the same
    exchange among the H host leaders, one per link, between the host's sum and its
    broadcast through the arena. The hooks' small parameters (a separate 8-bit
    all-reduce per bucket) are not part of it: they depend on the model's shapes."""
    n = topology.ranks
    if n < 2:
        return {}
    cpu = max(1.0, topology.oversubscription)

    def exchange(ranks: int, on_link: float) -> Dict[str, float]:
        """Every compressed all-reduce over ``ranks`` owners, each rank's bytes sharing its
        link ``on_link``-fold: a byte costs the link or the TCP copies, whichever is slower
        (as the dense formulas); the hook's work is CPU time of its own, scaled by the ranks
        per core."""
        def moved(sent: float) -> float:
            return max(on_link * sent * m["beta"], cpu * sent * m.get("cpu_beta", 0.0))

        costs = {}
        for density in DENSITIES:
            costs[f"topk d={density:g}"] = (2.0 * m["alpha"] + 2.0 * (2 * (ranks - 1) - 1) * m["delta"]
                                            + moved(topk_wire_bytes(nbytes, density, ranks))
                                            + cpu * nbytes * codec["topk"])
        for bits in BITS:
            wire = nbytes * bits / 32.0 + nbytes / 4.0 / QUANT_BLOCK * 4.0
            costs[f"quantize {bits}-bit"] = (2.0 * m["alpha"] + 2.0 * (ranks - 2) * m["delta"]
                                             + moved(2.0 * (ranks - 1) / ranks * wire)
                                             + cpu * (nbytes * codec["quantize"]
                                                      + (ranks - 1) / ranks * wire * m["gamma"]))
        return costs

    # With L ranks per host, every rank sends (n - L)/(n - 1) of its bytes off the host
    # and the L ranks share its link.
    L = topology.ranks_per_host if topology.hosts > 1 else 1
    out = exchange(n, L * (n - L) / (n - 1.0) if topology.hosts > 1 else 1.0)
    if topology.hosts > 1 and L > 1:
        # TopKState / QuantizeState(hosts=...): the host's sum through the arena (pycomm's
        # shm reduce is its all-reduce), the leaders' exchange, the leader's broadcast.
        local = dict(_C.allreduce_costs(int(nbytes), cost=_cost_object(m), world_size=L, one_host=True, hosts=0,
                                        oversubscription=topology.oversubscription,
                                        ingress_limited=topology.ingress_limited))["shm"]
        broadcast = m["shm_alpha"] + nbytes * m["shm_beta"]
        for name, seconds in exchange(topology.hosts, 1.0).items():
            out[f"{name} hosts"] = local + seconds + broadcast
    return out


def winners(costs: Dict[str, float]) -> Tuple[str, str]:
    """(the cheapest dense algorithm, the cheapest of all)."""
    dense = {k: v for k, v in costs.items() if not k.startswith(("topk", "quantize"))}
    return min(dense, key=dense.get), min(costs, key=costs.get)


def break_even_gbps(model: Dict[str, float], topology: Topology, nbytes: int, name: str,
                    codec: Optional[Dict[str, float]] = None) -> Optional[float]:
    """The link speed (Gbit/s) below which the compressed all-reduce ``name`` beats the
    best dense network algorithm at ``nbytes``; None when it never pays (even at 1
    Mbit/s), inf when it always does (even at 10 Tbit/s). Where the TCP copies are
    slower than the link (cpu_beta) both sides stop depending on the link, so the
    crossing is found by bisection in log space rather than by intersecting lines."""
    def gain(gbps):  # > 0 where compression wins
        t = Topology(topology.hosts, topology.ranks_per_host, gbps, topology.latency_s,
                     topology.oversubscription, topology.ingress_limited)
        costs = predict(model, t, nbytes, codec)
        dense = min(v for k, v in costs.items() if k in ("ring", "sharded", "tree"))
        return dense - costs[name]
    lo, hi = 1e-3, 1e4
    if gain(lo) <= 0:
        return None
    if gain(hi) > 0:
        return math.inf
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return hi


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _fmt_const(name: str, value: float) -> str:
    if name == "cpu_beta_oneway" and value <= 0:
        return "cpu_beta / 2 (not measured)"
    if name == "link_burst":
        return f"{value / 1024:.0f} KiB" if value > 0 else "0 (none)"
    if "beta" in name or name == "gamma":
        return f"{1.0 / value / 1e9:.2f} GB/s" if value > 0 else "0 (free)"
    return f"{value * 1e6:.1f} us"


def _rate(text: str) -> float:
    t = text.strip().lower().replace("bit/s", "bit").replace("bps", "bit")
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("g", 1.0), ("m", 1e-3)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * scale
    return float(t)


def _latency(text: str) -> float:
    t = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * scale
    return float(t)


def oversubscription(ranks: int, cores: Optional[int] = None) -> float:
    """Ranks per core when ``ranks`` share this machine's cores (at least 1)."""
    return max(1.0, ranks / float(cores or os.cpu_count() or 1))
