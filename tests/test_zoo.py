"""The Hugging Face zoo (``examples/hf_zoo.py``): every causal, masked and sequence-to-sequence LM type
transformers builds from a tiny float64 config, cut at run time at its repeated layers, against plain
autograd. None silently wrong, none left uncut, and at least 120 types bit-exact (1e-12 relative),
both in full and with every layer's rebuild stopped early (each sweep run twice: the first learns
the tails, the second skips their kernels)."""

import collections
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hf_zoo  # noqa: E402


def test_every_hugging_face_lm_type_is_exact_or_refused_never_silently_wrong(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        outcomes = hf_zoo.main(["--stop-every-tail"])
    finally:
        torch.set_num_threads(threads)
    table = capsys.readouterr().out
    counts = collections.Counter(outcomes.values())
    assert counts["wrong"] == 0 and counts["no cut"] == 0, table
    assert counts["exact"] >= 120, (counts, table)
    assert int(table.strip().splitlines()[-1].split()[0]) > 500, table  # kernels skipped
