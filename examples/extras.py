"""What the examples need beyond eae_func's own dependencies, and where they write.

Each optional import names the extra of ``pyproject.toml`` that installs it when it is missing
(``examples``: tqdm, matplotlib, scikit-learn, LightPipes; ``hf``: transformers, accelerate;
``bench``: eae-runtime, peft). Plots go to the folder ``--out`` names, by default ``eae_out/`` in
the current directory (ignored by git); ``python examples/make_figures.py`` remakes the
documentation's own into ``docs/figures/``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
from typing import Any

OUT = pathlib.Path("eae_out")


@contextlib.contextmanager
def extra(name: str):
    """Imports in the block that find a module missing say which extra installs it."""
    try:
        yield
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{e.name or e} is not installed; it comes with eae_func's {name} extra: pip install 'eae_func[{name}]'",
            name=e.name,
        ) from e


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no window)."""
    with extra("examples"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=pathlib.Path, default=OUT, help=f"folder for the plots (default: ./{OUT}, ignored by git)"
    )


def save(fig: Any, out: pathlib.Path, name: str, dpi: int) -> None:
    """``fig`` written to ``out/name`` (``out`` made if missing), and the path printed."""
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / name, dpi=dpi)
    print(f"plot: {out / name}")
