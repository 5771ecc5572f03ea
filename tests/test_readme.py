"""Every code block of README.md and of the documentation's pages is executed.

Python blocks run verbatim, in order (the README, then the pages in the site's nav order), in one
namespace. Shell blocks: each
command line runs from the repository root, except `pip install ...` steps (the
test environment is their result) and the test command itself (this run);
benchmark scripts run with `--quick` appended so the suite stays fast, which
checks that the command and its flags work, not the numbers.
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


def test_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    blocks = [(body, page) for lang, body, page in BLOCKS if lang == "python"]
    assert len({page for _, page in blocks}) > 3
    for body, page in blocks:
        if "import transformers" in body and importlib.util.find_spec("transformers") is None:
            continue  # the optional extra eae_func[hf] is not installed
        if "import lightning" in body and importlib.util.find_spec("lightning") is None:
            continue  # the optional extra eae_func[lightning] is not installed
        exec(compile(body, page, "exec"), namespace)


@pytest.mark.parametrize("words", list(shell_commands()), ids=lambda w: " ".join(w))
def test_shell_commands_run(words):
    if words[0] == "python":
        words = [sys.executable, *words[1:]]
    if any(w.startswith("examples/bench") for w in words):
        words = [*words, "--quick"]
    tools = str(pathlib.Path(sys.executable).parent)  # this environment's ruff, pyright, mkdocs (and its python)
    env = {**os.environ, "PATH": tools + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
