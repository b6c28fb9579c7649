"""A relay in the middle of an authenticated connection (issue #40, finding 2).

Two ranks over TCP with PYCOMM_SECRET set rendezvous through a FileStore. A third
process that can only write the store replaces rank 0's address record with its own
listener's, forwards the handshake between rank 1 and rank 0 unchanged (it cannot
forge it: it does not know the secret), then flips one byte deep in rank 1's stream
(inside the all-reduce's payload). With PYCOMM_WIRE=integrity (the default) every
frame carries a MAC under a key the relay cannot derive: rank 0 raises, naming rank
1, and no rank returns a wrong result. With PYCOMM_WIRE=none (the control) the same
relay makes the all-reduce finish with one wrong element and no error.
Output of the victim (rank 0) is checked for the sender's name."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ELEMENTS = 1 << 20  # 4 MiB of float32
FLIP_AT = 104 + (1 << 20)  # past the connector's hello (64) and proof (40), 1 MiB into its stream

RANK = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    rank, store, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if rank == 1:  # joins once the relay has rewritten rank 0's address
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
    import torch, torch.distributed as dist
    import pycomm
    dist.init_process_group("pycomm", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.full((%d,), float(rank + 1))
    try:
        dist.all_reduce(t)
        wrong = int((t != 3.0).sum())
        print(json.dumps({"rank": rank, "wrong": wrong}), flush=True)
    except Exception as exc:
        print(json.dumps({"rank": rank, "error": str(exc)}), flush=True)
    os._exit(0)
    """ % ELEMENTS
)

RELAY = textwrap.dedent(
    """
    import os, socket, struct, sys, threading, time
    store, ready, flip_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def records():
        # torch's FileStore file: (uint32 length, "/" + key), (uint32 length, value), appended.
        try:
            data = open(store, "rb").read()
        except FileNotFoundError:
            return {}
        out, at = {}, 0
        while at + 4 <= len(data):
            (n,) = struct.unpack_from("<I", data, at); key = data[at + 4:at + 4 + n]; at += 4 + n
            if at + 4 > len(data): break
            (m,) = struct.unpack_from("<I", data, at); value = data[at + 4:at + 4 + m]; at += 4 + m
            if at > len(data): break
            out[key] = value
        return out

    deadline = time.monotonic() + 60
    key = value = None
    while key is None and time.monotonic() < deadline:
        for k, v in records().items():
            if k.endswith(b"addr/0"):
                key, value = k, v
        time.sleep(0.005)
    host, port = value.decode().rsplit(" ", 1)
    listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(4)
    # Appends a newer record of the key, under the lock torch's FileStore takes (no torch here:
    # the relay is only something that can write the store).
    import fcntl
    record = ("127.0.0.1 %d" % listener.getsockname()[1]).encode()
    with open(store, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(struct.pack("<I", len(key)) + key + struct.pack("<I", len(record)) + record)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    open(ready, "w").close()
    victim_side, _ = listener.accept()  # rank 1 connecting to "rank 0"
    upstream = socket.create_connection((host, int(port)))

    def pump(src, dst, flip):
        seen = 0
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            if flip and seen <= flip_at < seen + len(data):
                data = bytearray(data); data[flip_at - seen] ^= 0x40; data = bytes(data)
                print("flipped", flush=True)
            seen += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass

    threads = [threading.Thread(target=pump, args=(victim_side, upstream, True)),
               threading.Thread(target=pump, args=(upstream, victim_side, False))]
    for t in threads: t.start()
    for t in threads: t.join(60)
    """
)


def _run(tmp_path, wire):
    store, ready = str(tmp_path / "store"), str(tmp_path / "relay-ready")
    env = dict(os.environ, PYCOMM_SECRET="a job secret the relay does not know", PYCOMM_TRANSPORT="tcp",
               PYCOMM_SOCKETS_PER_PEER="1", PYCOMM_IO_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYCOMM_WIRE", None)
    if wire is not None:
        env["PYCOMM_WIRE"] = wire
    relay = subprocess.Popen([sys.executable, "-c", RELAY, store, ready, str(FLIP_AT)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), store, ready], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = []
    try:
        for proc in ranks + [relay]:
            out, err = proc.communicate(timeout=180)
            outputs.append((out or "") + (err or ""))
    finally:
        for proc in ranks + [relay]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    import json
    results = {}
    for text in outputs[:2]:
        for line in text.splitlines():
            if line.startswith("{"):
                item = json.loads(line)
                results[item["rank"]] = item
    return results, outputs


def test_wire_mode_defaults_to_integrity_with_a_secret():
    from pycomm import config

    secret = {"PYCOMM_SECRET": "a job secret long enough"}
    assert config.load_config(secret).wire == "integrity"
    assert config.load_config({}).wire == "none"  # the key is in the store: MACs would not stop a relay
    assert config.load_config(dict(secret, PYCOMM_WIRE="none")).wire == "none"
    assert config.load_config({"PYCOMM_WIRE": "integrity"}).wire == "integrity"
    with pytest.raises(ValueError, match="PYCOMM_WIRE must be one of auto, integrity, none"):
        config.load_config({"PYCOMM_WIRE": "encrypt"})


def test_relay_that_flips_a_byte_makes_the_victim_raise(tmp_path):
    results, outputs = _run(tmp_path, None)  # PYCOMM_WIRE unset: a secret makes it integrity
    assert "flipped" in outputs[2], outputs
    assert 0 in results, outputs
    assert "error" in results[0], results
    assert "rank 1" in results[0]["error"] and "integrity check" in results[0]["error"], results[0]
    for item in results.values():  # nobody returns a wrong result
        assert item.get("wrong", 0) == 0, results


def test_without_wire_integrity_the_relay_goes_unnoticed(tmp_path):
    # The control: the same relay, PYCOMM_WIRE=none; the call finishes with one wrong element.
    results, outputs = _run(tmp_path, "none")
    assert "flipped" in outputs[2], outputs
    assert results.get(0, {}).get("wrong") == 1 or results.get(1, {}).get("wrong") == 1, (results, outputs)
