"""Control messages between ranks without pickle.

torch.distributed's ``*_object`` collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``) unpickle what the other ranks send: a process that can reach a
rank's connection (or rewrite the store that tells the rank where its peers are) has it
run any code. pycomm sends its control values through this module instead:

* JSON-serialisable values (numbers, strings, lists, dicts with string keys, None) travel
  as UTF-8 JSON in uint8 tensors: :func:`all_gather_json`, :func:`broadcast_json`;
* state with tensors (checkpoints) travels as ``torch.save`` bytes and is read back with
  ``torch.load(weights_only=True)``, which builds tensors and plain containers only and
  refuses anything else: :func:`tensors_to_bytes`, :func:`bytes_to_tensors`, with
  :func:`all_gather_bytes`, :func:`gather_bytes`, :func:`broadcast_bytes`.

Every exchange sends the lengths first (int64, one per rank), then the payloads padded
to the longest. A value that is not JSON is refused at the sender (TypeError); bytes that
are not what the receiver expects raise ValueError there (JSON) or
``pickle.UnpicklingError`` (``weights_only``), never run anything. Tensors are on the CPU,
or on the current CUDA device for an NCCL group.
"""

from __future__ import annotations

import io
import json
from typing import Any, List, Optional

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json", "all_gather_bytes", "gather_bytes", "broadcast_bytes",
           "tensors_to_bytes", "bytes_to_tensors"]


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode_json(value: Any) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"pycomm control: {type(value).__name__} is not a JSON value ({exc})") from None


def _decode_json(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"pycomm control: a peer sent {len(data)} bytes that are not JSON ({exc})") from None


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _lengths(n: int, group, device: torch.device) -> List[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    everyone = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [int(t.item()) for t in everyone]


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        out[: len(data)] = _as_tensor(data, device)
    return out


def all_gather_bytes(data: bytes, group=None) -> List[bytes]:
    """Every rank's ``data``, in rank order (collective over ``group``)."""
    device = _device(group)
    lengths = _lengths(len(data), group, device)
    size = max(lengths)
    if size == 0:
        return [b"" for _ in lengths]
    everyone = [torch.empty(size, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(everyone, _padded(data, size, device), group=group)
    return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(everyone, lengths)]


def gather_bytes(data: bytes, dst: int = 0, group=None) -> Optional[List[bytes]]:
    """Every rank's ``data`` on group rank ``dst`` in rank order (None elsewhere)."""
    device = _device(group)
    lengths = _lengths(len(data), group, device)
    size = max(lengths)
    if size == 0:
        return [b"" for _ in lengths] if dist.get_rank(group) == dst else None
    root = dst if group is None else dist.get_global_rank(group, dst)
    mine = _padded(data, size, device)
    if dist.get_rank(group) == dst:
        everyone = [torch.empty(size, dtype=torch.uint8, device=device) for _ in lengths]
        dist.gather(mine, everyone, dst=root, group=group)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(everyone, lengths)]
    dist.gather(mine, None, dst=root, group=group)
    return None


def broadcast_bytes(data: Optional[bytes], src: int = 0, group=None) -> bytes:
    """Group rank ``src``'s ``data`` on every rank (``data`` is ignored elsewhere)."""
    device = _device(group)
    root = src if group is None else dist.get_global_rank(group, src)
    mine = dist.get_rank(group) == src
    length = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=root, group=group)
    n = int(length.item())
    if n == 0:
        return b""
    buffer = _as_tensor(data, device) if mine else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=root, group=group)
    return bytes(buffer.cpu().numpy().tobytes())


def all_gather_json(value: Any, group=None) -> List[Any]:
    """Every rank's JSON-serialisable ``value``, in rank order. JSON has no tuples (they
    come back as lists) and only string keys."""
    return [_decode_json(data) for data in all_gather_bytes(_encode_json(value), group)]


def broadcast_json(value: Any, src: int = 0, group=None) -> Any:
    """Group rank ``src``'s JSON-serialisable ``value`` on every rank."""
    data = _encode_json(value) if dist.get_rank(group) == src else None
    return _decode_json(broadcast_bytes(data, src, group))


def tensors_to_bytes(state: Any) -> bytes:
    """``state`` (tensors in dicts, lists, tuples, numbers, strings) as ``torch.save`` bytes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def bytes_to_tensors(data: bytes) -> Any:
    """What :func:`tensors_to_bytes` wrote, read with ``torch.load(weights_only=True)``:
    tensors and plain containers only (anything else raises pickle.UnpicklingError)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
