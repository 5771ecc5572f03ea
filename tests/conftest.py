import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny float64 problems: intra-op threads only add overhead (and stall on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def grad_mode_is_left_as_found():
    """No test, and nothing the library runs in it, leaves autograd off (a generator suspended inside
    ``torch.no_grad()`` did: every later test's forward then ran without a graph)."""
    yield
    assert torch.is_grad_enabled(), "autograd was left disabled"
