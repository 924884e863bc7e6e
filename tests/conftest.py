"""Test-wide settings: Triton interpreter on CPU-only machines, hypothesis profiles."""

import os

# Must be set before any module imports triton kernels.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
    # Tiny test models: torch's CPU thread pool only adds synchronisation, and stalls badly on a busy 2-core box
    # (pytest-xdist already runs one worker per core).
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
