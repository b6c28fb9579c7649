"""auto's choice between the ring and sharded (halving/doubling) where a link is the
limit (issue #42 item 5), on the namespace model that `python -m pycomm.plan --validate`
calibrated (benchmarks/results/plan_validation_burst.txt's header) with each host's
egress at 1 Gbit/s, as the validation hands it to the ranks (validation.link_model).

Measured in that run (ms, 4 and 8 hosts on 2 cores): at 1 Gbit/s the ring was the
fastest or within 1% of it at every size, sharded up to 24% slower; without a rate
sharded was the fastest at 8 hosts from 16 MiB (94 against the ring's 103, 397 against
505). The model gave both the same byte terms, so sharded won at every size by its
fewer messages alone.
"""
from __future__ import annotations

import pytest

import pycomm
from pycomm import plan
from pycomm.plan.validation import link_model

K = pycomm._C
MiB = 1 << 20

# The namespace path's constants of plan_validation_burst.txt (alpha 45.5 us, beta 0,
# gamma 17.58 GB/s, delta 8.0 us, shm_alpha 2.0 us, shm_beta 10.00 GB/s, cpu_beta
# 1.33 GB/s, cpu_beta_oneway 2.31 GB/s, link_burst 0), in seconds per message / byte.
NETNS = dict(plan.DEFAULT_MODEL, alpha=45.5e-6, beta=0.0, gamma=1 / 17.58e9, delta=8.0e-6, shm_alpha=2.0e-6,
             shm_beta=1 / 10.0e9, cpu_beta=1 / 1.33e9, cpu_beta_oneway=1 / 2.31e9, link_burst=0.0)


def pick(model, size, hosts):
    cost = plan.model._cost_object(model)
    return K._select_algorithm(size, hosts, False, hosts, cost, oversubscription=hosts / 2.0,
                               ingress_limited=False)


@pytest.mark.parametrize("hosts", [4, 8])
@pytest.mark.parametrize("size", [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB])
def test_link_bound_takes_the_ring(hosts, size):
    # 1 Gbit/s: the link is the limit (16.7 ns per byte of 2P against the CPU's 3-6).
    assert pick(link_model(NETNS, "1gbit"), size, hosts) == "ring"


@pytest.mark.parametrize("hosts,size", [(4, 1 * MiB), (4, 4 * MiB), (8, 16 * MiB), (8, 64 * MiB)])
def test_cpu_bound_keeps_sharded(hosts, size):
    # No rate: the CPU is the limit and sharded's fewer steps stay (measured the fastest
    # at these points).
    assert pick(link_model(NETNS, None), size, hosts) == "sharded"


def test_link_share_is_charged_only_to_sharded_link_term():
    m = link_model(NETNS, "1gbit")
    cost = plan.model._cost_object(m)
    costs = dict(K.allreduce_costs(16 * MiB, 4, False, 4, cost, oversubscription=2.0, ingress_limited=False))
    part = 3 / 4 * 16 * MiB
    link = 2 * part * m["beta"]
    assert costs["ring"] == pytest.approx(6 * m["alpha"] + link)
    assert costs["sharded"] == pytest.approx(4 * m["alpha"] + 1.05 * link)
    # The built-in constants (beta stands for the link and the CPU: cpu_beta 0) keep
    # sharded's old cost: the same byte terms as the ring.
    base = plan.model._cost_object(plan.DEFAULT_MODEL)
    d = dict(K.allreduce_costs(16 * MiB, 4, False, 4, base))
    assert d["ring"] - d["sharded"] == pytest.approx(2 * plan.DEFAULT_MODEL["alpha"])
