"""Shared test setup: GPU tests skip themselves where they cannot run, and a fixture for the
tiny model's CPU runs. Config builders live in helpers.py (plain functions: modules use them at
import time too)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test marked `gpu` is skipped without CUDA, and under TRITON_INTERPRET=1 (GPU tests
    compile their kernels for real). torch is imported only when some collected test is a gpu
    test, so collecting torch-free tests stays torch-free."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        reason = "gpu test: not under TRITON_INTERPRET=1"
    else:
        import torch

        if torch.cuda.is_available():
            return
        reason = "gpu test: needs CUDA"
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The tiny model is latency-bound: one intra-op thread is several times faster. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
