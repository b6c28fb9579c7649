"""fp16_wrapper / bf16_wrapper: any hook on the bucket cast to 16 bits."""
from typing import Callable

import torch

from ._common import _future_tensor

def _cast_wrapper(hook: Callable, dtype: torch.dtype, name: str) -> Callable:
    if not callable(hook):
        raise TypeError(f"pycomm {name}: hook must be callable (got {type(hook).__name__})")

    def wrapped(state, bucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(state, bucket)

        def restore(f):
            original.copy_(_future_tensor(f))
            return original

        return fut.then(restore)

    inner = getattr(hook, "__name__", type(hook).__name__)
    wrapped.__name__ = f"{name}_{inner}"
    wrapped.__qualname__ = wrapped.__name__
    wrapped.__doc__ = f"{inner} on the bucket cast to {dtype} (result cast back to the bucket's dtype)."
    return wrapped


def fp16_wrapper(hook: Callable) -> Callable:
    """``hook`` run on the bucket cast to float16; the averaged result is copied back into
    the original (float32) bucket. With :func:`topk_hook` the values travel as float16
    (6 bytes per entry instead of 8); with :func:`allreduce_hook` it is fp16 compression;
    with :func:`quantize_hook` only the input is rounded (scales stay float32).
    Residuals stay float32."""
    return _cast_wrapper(hook, torch.float16, "fp16_wrapper")


def bf16_wrapper(hook: Callable) -> Callable:
    """As :func:`fp16_wrapper`, with bfloat16."""
    return _cast_wrapper(hook, torch.bfloat16, "bf16_wrapper")
