"""The module paths from before the ``program`` / ``core`` / ``drivers`` layout: ``import
eae_func.chain`` (or ``from eae_func.options import Options``) still finds the module at its new
place, ``eae_func.program.chain``, with a DeprecationWarning that names it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["ALIASED", "MOVED", "SPLIT", "install"]

MOVED = {
    **dict.fromkeys("capture chain fsdp function module_chain physical user_code".split(), "program"),
    **dict.fromkeys(
        "boundary compiled costates diagnose early_stop fold microbatch options remat replay runner tape ties timing "
        "update vjp".split(),
        "core",
    ),
    **dict.fromkeys("cuts in_backward input_writes model_sweep physical_cuts switch sweep".split(), "drivers"),
}
"""Each module that stood at ``eae_func/<name>.py`` before the folders -> its folder now."""

SPLIT = {"chain": "eae_func.program.module_chain"}
"""A moved module whose functions went on to another module: ``eae_func.chain.from_module`` (and the
other names of ``module_chain.__all__``) still reads them, with a DeprecationWarning."""

ALIASED: set[str] = set()
"""The moved modules whose names the package binds, put in ``sys.modules`` by ``install``."""


class Moved(ModuleType):
    """A moved module under its old path: every attribute is read from the module at its new path."""

    def __init__(self, name: str, target: ModuleType):
        super().__init__(name, target.__doc__)
        self._target = target

    def __getattr__(self, attr: str) -> Any:
        try:
            return getattr(self._target, attr)
        except AttributeError:
            split = SPLIT.get(self.__name__.rpartition(".")[2])
            if split is None or attr not in (went := importlib.import_module(split)).__all__:
                raise
        warnings.warn(f"{self.__name__}.{attr} moved to {split}", DeprecationWarning, stacklevel=2)
        return getattr(went, attr)

    def __dir__(self) -> list[str]:
        return dir(self._target)


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``eae_func.<name>`` for a moved module and loads it as a ``Moved`` view of the module at
    its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, name = fullname.rpartition(".")
        if package != "eae_func" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        name = spec.name.rpartition(".")[2]
        new = f"eae_func.{MOVED[name]}.{name}"
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return Moved(spec.name, importlib.import_module(new))

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path ran when it was imported."""


def install(package: ModuleType) -> None:
    """Put the finder on ``sys.meta_path`` (once). A moved module whose name the package binds
    (``ef.sweep``, the function; ``ef.remat``, the module) is put in ``sys.modules`` under its old
    path now, without a warning: a first import through the finder would rebind the package's name."""
    for name, folder in MOVED.items():
        if name in vars(package):
            sys.modules.setdefault(f"eae_func.{name}", importlib.import_module(f"eae_func.{folder}.{name}"))
            ALIASED.add(name)
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.append(OldPaths())
