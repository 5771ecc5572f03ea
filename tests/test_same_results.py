"""``examples/same_results.py``, the check that a refactor changed no result: its sweeps are
deterministic (two runs, every tensor equal), and a changed tensor, a missing one or a new one
makes ``--compare`` fail, naming it."""

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "same_results.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_same_results_passes_on_the_same_code_and_fails_on_any_changed_tensor(tmp_path):
    saved = tmp_path / "before.pt"
    assert run("--save", str(saved)).returncode == 0
    same = run("--compare", str(saved))
    assert same.returncode == 0 and " 0 differ, 0 missing, 0 new" in same.stdout, same.stdout + same.stderr
    before = torch.load(saved)
    assert len(before) > 500 and any(k.startswith("cuts") for k in before) and any("estimator" in k for k in before)
    key = next(k for k in before if k.startswith("enable") and before[k].is_floating_point())
    changed = dict(before)
    changed[key] = torch.nextafter(before[key], torch.full_like(before[key], float("inf")))  # one ulp
    changed["a tensor the new code lacks"] = torch.zeros(1)
    changed.pop(next(iter(before)))
    torch.save(changed, saved)
    out = run("--compare", str(saved))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"differs: {key}" in out.stdout and "missing: a tensor the new code lacks" in out.stdout
    assert "1 differ, 1 missing, 1 new" in out.stdout, out.stdout
