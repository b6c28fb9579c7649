"""pycomm.train.memory.RssPeak: the peak-RSS growth a training run reports."""

from __future__ import annotations

import gc
import mmap
import os

import pytest

from pycomm.train.memory import RssPeak

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")

MIB = 2 ** 20
STEP = 48 * MIB
PAGE = mmap.PAGESIZE


def _resident(nbytes: int) -> mmap.mmap:
    """``nbytes`` of new resident memory, given back to the system when the object goes.
    A fresh anonymous mapping, touched page by page: a torch tensor or a malloc of the same
    size may reuse chunks that earlier tests in this process freed and that are still
    resident (in the suite a 48 MiB tensor added nothing), and freed, may stay resident."""
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, PAGE):
        block[offset] = 1
    return block


class _Cycle:
    """Garbage that only the cyclic collector frees (as a trainer of an earlier run is)."""

    def __init__(self, nbytes: int) -> None:
        self.me = self
        self.data = _resident(nbytes)


def test_garbage_of_an_earlier_run_is_not_counted_in_the_start():
    """A process that trains twice (the test suite, a notebook) still holds the first run's
    garbage when the second run's RssPeak is made; when the collector frees it during the
    model build, the resident set falls below ``start`` and the growth came out negative
    (CI: test_fsdp_tp_pp_match_single_process_on_two_ranks, ``rss_peak_growth > 0``)."""
    gc.collect()
    gc.disable()  # the collection happens where the test says, not at random
    try:
        _Cycle(256 * MIB)  # dropped at once, freed only by a collection
        holding = RssPeak._read("VmRSS")
        rss = RssPeak()
        assert rss.start < holding - 200 * MIB, "the start still holds the earlier run's garbage"
        gc.collect()  # during the model build
        rss.reset_peak()
        step = _resident(STEP)  # the training steps
        growth = rss.growth()
        del step
    finally:
        gc.enable()
    assert growth is not None
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB


def test_growth_counts_what_the_run_holds():
    rss = RssPeak()
    model = _resident(STEP)
    rss.reset_peak()
    growth = rss.growth()
    del model
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB


def test_memory_freed_while_the_model_is_built_does_not_make_it_negative():
    """Memory the process held before the model was built (a buffer of an earlier run, a
    cache) and freed during the build: the growth is still what the training steps add."""
    held = _resident(256 * MIB)
    rss = RssPeak()
    del held  # freed during the model build
    rss.reset_peak()
    step = _resident(STEP)
    growth = rss.growth()
    del step
    assert STEP - 8 * MIB <= growth < 2 * STEP, growth / MIB
