"""Shared pytest configuration.

Markers (registered in pyproject.toml):
  slow  end-to-end tests; CI runs them, `make test-fast` skips them.
  gpu   needs a CUDA device; skipped cleanly where torch sees none.
"""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
