"""The public surface is what each public module's ``__all__`` says, and the API reference
(docs/api.md, built by mkdocs) documents every one of those names."""

import importlib
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = [
    "eae_func",
    "eae_func.passes",
    "eae_func.estimators",
    "eae_func.core.remat",
    "eae_func.distributed",
    "eae_func.distributed.codecs",
    "eae_func.models",
    "eae_func.tree",
    "eae_func.integrations.transformers",
    "eae_func.integrations.lightning",
]


def resolve(path: str):
    """The object a documented id names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            obj = getattr(obj, name)
        return obj
    raise LookupError(path)


@pytest.mark.parametrize("name", PUBLIC)
def test_all_lists_only_what_the_module_has(name):
    module = importlib.import_module(name)
    assert all(hasattr(module, n) for n in module.__all__)
    assert len(set(module.__all__)) == len(module.__all__)


def test_the_api_reference_documents_every_public_name(tmp_path):
    pytest.importorskip("mkdocstrings")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "-q", "-d", str(tmp_path)], cwd=ROOT, check=True, capture_output=True
    )
    ids = set(re.findall(r'id="(eae_func[\w.]*)"', (tmp_path / "api" / "index.html").read_text()))
    documented = {id(resolve(i)) for i in ids}
    missing = [
        f"{name}.{n}"
        for name in PUBLIC
        for n in importlib.import_module(name).__all__
        if not isinstance(obj := getattr(importlib.import_module(name), n), types.ModuleType)
        and id(obj) not in documented
    ]
    assert not missing, f"public but not in docs/api.md: {missing}"


def test_the_module_functions_moved_out_of_chain_still_import_from_its_old_path_with_a_warning():
    """``from_module`` and the write-backs moved from ``eae_func.chain`` to ``eae_func.program.module_chain``;
    the old path gives the same function and says where it went."""
    import warnings

    from eae_func.program import module_chain

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("eae_func.chain")
    for name in ("from_module", "write_back", "write_grads", "write_buffers", "trainable_names"):
        with pytest.warns(DeprecationWarning, match=f"eae_func.chain.{name} moved to eae_func.program.module_chain"):
            assert getattr(old, name) is getattr(module_chain, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        old.no_such_name  # noqa: B018


def test_the_modules_moved_into_program_core_and_drivers_import_from_their_old_paths_with_a_warning():
    """``import eae_func.chain`` (and every moved module's old path) warns and reads the module at
    its new path; the names the package binds keep their meaning (``ef.sweep`` the function,
    ``ef.remat`` the module) whatever was imported under the old paths."""
    import warnings

    import eae_func as ef
    from eae_func.old_paths import ALIASED, MOVED

    for name, folder in MOVED.items():
        new = importlib.import_module(f"eae_func.{folder}.{name}")
        if name not in ALIASED:  # imported afresh, whatever an earlier test imported
            sys.modules.pop(f"eae_func.{name}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module(f"eae_func.{name}")
        if name in ALIASED:  # bound by the package: aliased when it was imported, silently
            assert old is new and not caught
            continue
        assert [str(w.message) for w in caught] == [f"eae_func.{name} moved to eae_func.{folder}.{name}"]
        assert all(getattr(old, n) is getattr(new, n) for n in new.__all__)
    from eae_func.chain import Chain  # noqa: F401  (a from-import of the old path)

    assert ALIASED == {"remat", "sweep"}
    assert callable(ef.sweep) and ef.sweep is importlib.import_module("eae_func.drivers.sweep").sweep
    assert ef.remat is importlib.import_module("eae_func.core.remat")
