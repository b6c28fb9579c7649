"""The all-reduce cost model, calibrated on this host, and what it predicts elsewhere.

    python -m pycomm.plan --calibrate                 # measure this host, cache it
    python -m pycomm.plan --hosts 4 --ranks-per-host 8 --bandwidth 10gbit --latency 20us
    python -m pycomm.plan --extrapolate --plot plan.png
    python -m pycomm.plan --validate --out t.txt     # predicted against measured, namespaces (root)
    python -m pycomm.plan --validate-local            # predicted against measured, this host

The model is the one `auto` uses (csrc/algorithms/allreduce_registry.cc, read through
``pycomm._C.allreduce_costs``; docs/planner.md): a message costs alpha, a byte beta on
the link and cpu_beta of TCP copies at its two ends (a phase takes the larger of link
and CPU), cpu_beta_oneway per byte of a one-way transfer (the tree's phases), reducing
costs gamma per byte, the shared-memory arena has its own shm_alpha and shm_beta, and
each algorithm is a formula over them (ring, sharded =
halving/doubling, tree, shm, hierarchical). A topology adds its ranks per core
(oversubscription: the CPU terms scale by it) and whether links limit ingress (a NIC)
or egress only (tc tbf on the namespace hosts). The compressed all-reduces are
modelled here, in Python, since `auto` never picks them (a hook does): the dense
sharded exchange on the compressed bytes plus the measured encode and decode time per
input byte.

``--calibrate`` fits the constants to pycomm's own benchmark on this host (2 ranks:
ring over TCP loopback for alpha and cpu_beta, beta 0 since no link limits loopback,
the tree over TCP loopback for cpu_beta_oneway, the shared-memory algorithm for
shm_alpha and shm_beta, the reduction kernel for gamma, the compression kernels for
their encode cost) and caches them
(pycomm.config.cost_cache_path); groups created afterwards on this host use them
(PYCOMM_COST_MODEL). The benchmark runs it starts get their pycomm settings (transport,
streams, cost model) in ``BenchConfig.settings``, not through this process's environment.
A topology is hosts x ranks per host with a link bandwidth and
latency: beta = 1/bandwidth and alpha = latency + the per-message overhead measured
here. ``--validate`` does the same on network namespaces and compares predicted with
measured for 2, 4 and 8 hosts with and without a tbf rate.
"""

from .calibration import calibrate, load_calibration, save_calibration
from .cli import main
from .model import DEFAULT_MODEL, Topology, break_even_gbps, oversubscription, predict, topk_wire_bytes, winners
from .report import compression_table, extrapolation, stream_lines, table, write_plot  # noqa: F401  (as before the split)
from .validation import calibrate_netns, link_model, validate, validate_hosts, validation_table

__all__ = ["DEFAULT_MODEL", "Topology", "predict", "winners", "break_even_gbps", "calibrate", "validate",
           "calibrate_netns", "link_model", "validate_hosts", "validation_table", "oversubscription",
           "load_calibration", "save_calibration", "stream_lines", "topk_wire_bytes", "main"]
