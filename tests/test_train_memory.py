"""pycomm.train.memory.RssPeak: the peak-RSS growth a training run reports."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pycomm.train.memory import RssPeak

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")

MIB = 2 ** 20
# Each allocation the tests measure is over glibc's largest dynamic mmap threshold (32 MiB
# on 64-bit): a fresh mapping, whose pages are new, whatever the earlier tests in this
# process freed (a smaller one may reuse resident heap chunks and add nothing).
STEP = 48 * MIB


class _Cycle:
    """Garbage that only the cyclic collector frees (as a trainer of an earlier run is)."""

    def __init__(self, nbytes: int) -> None:
        self.me = self
        self.data = torch.ones(nbytes // 4)  # touched: resident


def test_garbage_of_an_earlier_run_is_not_counted_in_the_start():
    """A process that trains twice (the test suite, a notebook) still holds the first run's
    garbage when the second run's RssPeak is made; when the collector frees it during the
    model build, the resident set falls below ``start`` and the growth came out negative
    (CI: test_fsdp_tp_pp_match_single_process_on_two_ranks, ``rss_peak_growth > 0``)."""
    gc.collect()
    gc.disable()  # the collection happens where the test says, not at random
    try:
        _Cycle(256 * MIB)  # dropped at once, freed only by a collection
        rss = RssPeak()
        gc.collect()  # during the model build
        rss.reset_peak()
        step = torch.ones(STEP // 4)  # the training steps
        growth = rss.growth()
        del step
    finally:
        gc.enable()
    assert growth is not None
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB


def test_growth_counts_what_the_run_holds():
    rss = RssPeak()
    model = torch.ones(STEP // 4)
    rss.reset_peak()
    growth = rss.growth()
    del model
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB


def test_memory_freed_while_the_model_is_built_does_not_make_it_negative():
    """Memory the process held before the model was built (a buffer of an earlier run, a
    cache) and freed during the build: the growth is still what the training steps add."""
    held = torch.ones(256 * MIB // 4)
    rss = RssPeak()
    del held  # freed during the model build
    rss.reset_peak()
    step = torch.ones(STEP // 4)
    growth = rss.growth()
    del step
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB
