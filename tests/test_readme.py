"""Every code block of README.md and of the documentation's pages is executed.

Python blocks run verbatim, each alone in a fresh namespace, as a reader who copies one block runs
it: with its own imports and data. Shell blocks: each command line runs from the repository root,
except `pip install ...` steps (the test environment is their result) and the test command itself
(this run); benchmark scripts run with `--quick` appended so the suite stays fast, which checks that
the command and its flags work, not the numbers. No command changes what git tracks (the examples
write to `--out`, by default `eae_out/`, ignored); the docs' figures are made by
`examples/make_figures.py`, whose smoke run writes where it is told.
"""

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    *(f"docs/{page}" for page in re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)),
]
BLOCKS = [
    (lang, body, page)
    for page in PAGES
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
]


def shell_commands():
    seen = set()
    for lang, body, _ in BLOCKS:
        if lang != "bash":
            continue
        for line in body.strip().splitlines():
            for command in line.split("&&"):
                words = shlex.split(command)
                if not words or words[0] == "pip" or "pytest" in words or tuple(words) in seen:
                    continue
                seen.add(tuple(words))
                yield words


PYTHON = [  # each page's python blocks, numbered from 1
    pytest.param(page, body, id=f"{page}:{i}")
    for page in PAGES
    for i, body in enumerate((b for lang, b, p in BLOCKS if p == page and lang == "python"), 1)
]
EXTRAS = {"transformers": "hf", "lightning": "lightning"}  # what a block may import beyond eae_func's needs


def git_status() -> str | None:
    """What git sees changed in the checkout (``None`` outside a git checkout)."""
    done = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def test_the_pages_have_python_blocks():
    assert len({param.values[0] for param in PYTHON}) > 3


@pytest.mark.parametrize("page, body", PYTHON)
def test_python_block_runs_alone(page, body, tmp_path, monkeypatch):
    for module, extra in EXTRAS.items():
        if f"import {module}" in body and importlib.util.find_spec(module) is None:
            pytest.skip(f"the optional extra eae_func[{extra}] is not installed")
    monkeypatch.chdir(tmp_path)
    exec(compile(body, page, "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("words", list(shell_commands()), ids=lambda w: " ".join(w))
def test_shell_commands_run(words):
    if words[0] == "python":
        words = [sys.executable, *words[1:]]
    if any(w.startswith("examples/bench") for w in words):
        words = [*words, "--quick"]
    tools = str(pathlib.Path(sys.executable).parent)  # this environment's ruff, pyright, mkdocs (and its python)
    env = {**os.environ, "PATH": tools + os.pathsep + os.environ.get("PATH", "")}
    before = git_status()
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert git_status() == before, "the command changed the checkout"


def test_the_figures_command_writes_only_where_told(tmp_path):
    """Every plotting example's smoke run, through the one command that makes the docs' figures."""
    for module in ("matplotlib", "sklearn", "tqdm", "LightPipes"):
        pytest.importorskip(module)  # the examples extra
    before = git_status()
    command = [sys.executable, "examples/make_figures.py", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert git_status() == before, "make_figures.py --out elsewhere changed the checkout"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bench_train_curve.png",
        "bench_train_hf.png",
        "estimators_cosine.png",
        "train_lm_costates.png",
        "train_lm_loss.png",
        "train_physical.png",
    ]
