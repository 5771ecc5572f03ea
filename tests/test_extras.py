"""A missing optional dependency names the extra of ``pyproject.toml`` that installs it: the integrations
on import, the examples before they run; and every example's import of a module beyond eae_func's own
dependencies sits in ``with extra(name)``, where that extra lists it."""

import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTION = {"sklearn": "scikit-learn", "eae_runtime": "eae-runtime"}  # where the import name is not it


def requirement_names(requirements):
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def imports_by_extra(path):
    """``(module, extra)`` for every import in ``path``: the ``with extra(name)`` around it, ``"optional"``
    in a ``try`` that goes on without it (``except ImportError``), else ``None``."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, extra):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "extra":
                    extra = call.args[0].value
        if isinstance(node, ast.Try) and any(getattr(h.type, "id", None) == "ImportError" for h in node.handlers):
            extra = "optional"
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], extra) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], extra))
        for child in ast.iter_child_nodes(node):
            visit(child, extra)

    visit(tree, None)
    return found


def test_every_optional_import_of_the_examples_names_the_extra_that_lists_it():
    extras = {name: requirement_names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}
    own = requirement_names(PROJECT["dependencies"]) | {"eae-func", "__future__"}
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}
    wrong = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        for module, extra in imports_by_extra(path):
            dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
            if module in sys.stdlib_module_names or module in local or dist in own:
                continue
            if extra != "optional" and (extra is None or dist not in extras.get(extra, ())):
                wrong.append(f"{path.name}: {module} in extra({extra!r})")
    assert not wrong, wrong


def run_without(module, code):
    """``code`` in a fresh interpreter where importing ``module`` fails as if it were not installed."""
    program = f"import sys; sys.modules[{module!r}] = None; sys.path.insert(0, 'examples'); {code}"
    return subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ
    )


@pytest.mark.parametrize(
    "module, code, extra",
    [
        pytest.param("transformers", "import eae_func.integrations.transformers", "hf", id="integrations.transformers"),
        pytest.param("lightning", "import eae_func.integrations.lightning", "lightning", id="integrations.lightning"),
        pytest.param("sklearn", "import train_physical", "examples", id="train_physical-sklearn"),
        pytest.param("tqdm", "import train_lm", "examples", id="train_lm-tqdm"),
        pytest.param("LightPipes", "import train_optics", "examples", id="train_optics-LightPipes"),
        pytest.param("transformers", "import bench_frozen", "hf", id="bench_frozen-transformers"),
        pytest.param("matplotlib", "import train_lm; train_lm.main(['--quick'])", "examples", id="train_lm-matplotlib"),
    ],
)
def test_a_missing_dependency_names_its_extra(module, code, extra):
    if module == "matplotlib":
        pytest.importorskip("tqdm")  # what train_lm imports before it draws
    done = run_without(module, code)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ") and f"pip install 'eae_func[{extra}]'" in last, done.stderr
