"""No pickle from a peer (issue #40, finding 1).

(a) pycomm/ calls none of torch.distributed's ``*_object`` collectives (they unpickle what
    the other ranks send), no ``pickle.load(s)`` / ``Unpickler`` outside the two places that
    read a file their own child process wrote (listed below, with the reason), and no
    ``torch.load`` without ``weights_only=True``. Checked on the source with ``ast``.
(b) A payload that runs code when unpickled, sent by a peer through pycomm._control, is
    refused and runs nothing.
"""
import ast
import os
import pickle

import pytest

from mp_util import run_multiprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "pycomm")

OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list", "all_to_all_object"}
UNPICKLERS = {"load", "loads", "Unpickler"}
# Unpickling of local files between a parent and the processes it started, in a temporary
# directory of its own: no peer's bytes. (module path, call) -> why.
ALLOWED = {
    ("launch.py", "pickle.load"): "rank 0's result, written by a rank launch_workers spawned",
    ("bench/hosts.py", "pickle.load"): "the worker and config run_on_hosts wrote for its ranks, and rank 0's result",
}


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        base = _name(func.value)
        return f"{base}.{func.attr}" if base else func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def violations(root: str = ROOT):
    found = []
    for folder, _, files in os.walk(root):
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            pickle_names = set()  # from pickle import loads [as x]
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle"):
                    pickle_names |= {a.asname or a.name for a in node.names if a.name in UNPICKLERS}
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = _name(node.func)
                last = name.rpartition(".")[2]
                where = f"{rel}:{node.lineno}: {name}"
                if last in OBJECT_COLLECTIVES:
                    found.append(f"{where} (unpickles what the peers send)")
                elif (name.startswith(("pickle.", "_pickle.")) and last in UNPICKLERS) or name in pickle_names:
                    if (rel, f"pickle.{last}") not in ALLOWED:
                        found.append(f"{where} (unpickling)")
                elif name == "torch.load":
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not weights_only or not (isinstance(weights_only[0].value, ast.Constant)
                                                and weights_only[0].value.value is True):
                        found.append(f"{where} without weights_only=True")
    return found


def test_no_object_collectives_or_unpickling_in_pycomm():
    found = violations()
    assert not found, "pickle from a peer in pycomm/:\n  " + "\n  ".join(found)


def test_the_check_sees_them(tmp_path):
    pkg = tmp_path / "pycomm"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "a.py").write_text("import torch.distributed as dist\n"
                              "def f(x):\n    out = [None]\n    dist.all_gather_object(out, x)\n")
    (pkg / "b.py").write_text("from pickle import loads as l\nimport torch\n"
                              "def g(b, p):\n    torch.load(p)\n    return l(b)\n")
    (pkg / "bench" / "hosts.py").write_text("import pickle\ndef h(f):\n    return pickle.load(f)\n")
    found = violations(str(pkg))
    assert any(v.startswith("a.py:4: dist.all_gather_object") for v in found), found
    assert any(v.startswith("b.py:4: torch.load without") for v in found), found
    assert any(v.startswith("b.py:5: l (unpickling)") for v in found), found
    assert not any(v.startswith("bench/hosts.py") for v in found), found  # allowed, with its reason


class _OpenOnUnpickle:
    """Unpickling this creates ``path``: the stand-in for a peer's code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_peer(ctx, marker):
    from pycomm import _control

    problems = []
    evil = pickle.dumps(_OpenOnUnpickle(marker))
    # rank 1 sends a pickle where JSON is expected (the same collectives all_gather_json makes)
    if ctx.rank == 1:
        _control.all_gather_bytes(evil)
    else:
        try:
            got = _control.all_gather_json({"host": "a"})
            problems.append(f"all_gather_json accepted a pickle: {got!r}")
        except ValueError as exc:
            if "not JSON" not in str(exc):
                problems.append(f"all_gather_json: unexpected error {exc}")
    # rank 1 broadcasts the pickle where torch.save bytes are expected
    data = _control.broadcast_bytes(evil if ctx.rank == 1 else None, src=1)
    if ctx.rank == 0:
        try:
            _control.bytes_to_tensors(data)
            problems.append("bytes_to_tensors read a pickle of an object")
        except pickle.UnpicklingError:
            pass
    if os.path.exists(marker):
        problems.append(f"rank {ctx.rank}: the peer's payload ran (created {marker})")
    # and what honest ranks send arrives as sent
    import torch

    everyone = _control.all_gather_json({"rank": ctx.rank, "x": [1.5, None, "s" * ctx.rank]})
    if everyone != [{"rank": r, "x": [1.5, None, "s" * r]} for r in range(ctx.world_size)]:
        problems.append(f"all_gather_json: {everyone!r}")
    if _control.broadcast_json({"path": "/dev/shm/x"} if ctx.rank == 0 else None, src=0) != {"path": "/dev/shm/x"}:
        problems.append("broadcast_json")
    state = {"w": torch.arange(3 + ctx.rank, dtype=torch.float32), "step": ctx.rank, "t": (1, "a")}
    parts = _control.gather_bytes(_control.tensors_to_bytes(state), dst=0)
    if ctx.rank == 0:
        states = [_control.bytes_to_tensors(p) for p in parts]
        if [s["w"].tolist() for s in states] != [list(map(float, range(3 + r))) for r in range(ctx.world_size)] \
                or [s["t"] for s in states] != [(1, "a")] * ctx.world_size:
            problems.append(f"gather_bytes: {states!r}")
    elif parts is not None:
        problems.append("gather_bytes returned data off the root")
    return problems


@pytest.mark.parametrize("backend", ["pycomm", "gloo"])
def test_a_peers_pickle_is_refused_and_runs_nothing(tmp_path, backend):
    marker = str(tmp_path / "ran")
    for problems in run_multiprocess(_evil_peer, 2, backend=backend, args=(marker,), timeout_s=120):
        assert problems == []
    assert not os.path.exists(marker)
    pickle.loads(pickle.dumps(_OpenOnUnpickle(marker)))  # the payload is live: unpickling runs it
    assert os.path.exists(marker)


def test_a_value_that_is_not_json_is_refused_at_the_sender():
    from pycomm import _control

    with pytest.raises(TypeError, match="not a JSON value"):
        _control._encode_json(_OpenOnUnpickle("/nonexistent"))
