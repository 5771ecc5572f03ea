"""examples/gpu_check.py: skipped cleanly without a GPU, and its checks' logic passes on the CPU."""

import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script itself")
def test_without_a_gpu_the_check_says_skipped_and_exits_0():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no GPU: skipped" in done.stdout


def test_the_checks_pass_on_the_cpu_with_small_shapes():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("PASS") == 14 and "FAIL" not in done.stdout
