"""The network-namespace "hosts" of the multi-host tests (not a test module).

The code lives in :mod:`pycomm.netns` (``pycomm-bench --hosts`` uses it too); this
module re-exports it under its old name for the tests and benchmarks that import
``netns_util``. See pycomm/netns.py for the layout, naming and cleanup.
"""

from pycomm.netns import (  # noqa: F401  (re-exported)
    CLONE_NEWNET,
    IFNAME,
    PREFIX,
    SUBNET,
    NetnsHosts,
    cleanup_leftovers,
    descendants,
    enter_netns,
    kill_tree,
    netns_unavailable_reason,
    run_bounded,
)

__all__ = ["NetnsHosts", "netns_unavailable_reason", "enter_netns", "cleanup_leftovers", "run_bounded", "kill_tree",
           "descendants", "PREFIX", "IFNAME", "SUBNET"]
