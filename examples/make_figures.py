"""The documentation's figures, remade: each example that draws one runs with the settings the docs
describe and writes its plots into ``docs/figures/`` (run alone, every example writes to ``./eae_out``).

    python examples/make_figures.py                                     # all of them (hours on 2 CPU cores)
    python examples/make_figures.py train_physical bench_estimators     # some
    python examples/make_figures.py --quick --out /tmp/figures          # every script's smoke run, elsewhere

Needs the ``examples`` extra (matplotlib, scikit-learn, LightPipes, tqdm) and, for ``bench_train``,
the ``bench`` one; ``bench_train_hf`` the ``hf`` one.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
FIGURES = [  # script, the arguments of the docs' run -> the plots it writes
    ("bench_estimators", []),  # estimators_cosine.png
    ("bench_estimators", ["--control-variate"]),  # control_variate_mse.png (--quick: no plot)
    ("train_physical", []),  # train_physical.png
    ("train_optics", []),  # train_optics_cosine.png (--quick: no plot)
    ("train_lm", []),  # train_lm_loss.png, train_lm_costates.png
    ("bench_train", ["--depths", "12", "--steps", "7", "--blocks", "--curve"]),  # bench_train_curve.png
    (  # bench_train_hf.png
        "bench_train_hf",
        ["--seqs", "128", "256", "512", "1024", "--methods", "autograd", "hf-checkpoint", "ef.enable update= + chunks"]
        + ["--rounds", "3"],
    ),
]
SCRIPTS = list(dict.fromkeys(name for name, _ in FIGURES))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scripts", nargs="*", help=f"some of {', '.join(SCRIPTS)} (default: all)")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parent / "docs" / "figures")
    parser.add_argument("--quick", action="store_true", help="each script's smoke run: checks that they draw")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scripts) - set(SCRIPTS))
    if unknown:
        parser.error(f"no figure is made by {unknown}; the scripts are {SCRIPTS}")
    for name, arguments in FIGURES:
        if args.scripts and name not in args.scripts:
            continue
        command = [sys.executable, str(HERE / f"{name}.py"), *arguments, "--out", str(args.out)]
        command += ["--quick"] if args.quick else []
        print(f"$ {shlex.join(command)}", flush=True)
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
