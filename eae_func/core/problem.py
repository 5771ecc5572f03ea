"""What an estimator sees of one microbatch (``Problem``), which the runner builds after the forward
sweep, and the seeds of the probe streams it draws from (``probe_seed``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..adjoint import fold_in
from ..program.chain import Chain

__all__ = ["INPUT_STREAM", "PARAM_STREAM", "Problem", "probe_seed"]


# Seeds of the probe streams: fold_in(fold_in(fold_in(key, _DOMAIN), stage), stream); _DOMAIN keeps them
# apart from the boundary keys fold_in(key, l) that passes draw from.
_DOMAIN = 0x45535449_4D41544F  # "ESTIMATO"
INPUT_STREAM, PARAM_STREAM = 0, 1


def probe_seed(key: int, stage: int, stream: int) -> int:
    """Seed of the probes of ``stream`` (input or parameter directions) at ``stage`` for sweep key ``key``."""
    return fold_in(fold_in(fold_in(key, _DOMAIN), stage), stream)


STREAMS = {"input": INPUT_STREAM, "params": PARAM_STREAM}


@dataclasses.dataclass(frozen=True)
class Problem:
    """What an estimator sees of one sweep (one microbatch).

    chain, params, buffers:  the whole chain, one params / buffers entry per stage.
    x, loss_args:            the microbatch's input and loss arguments (``None`` on a pipeline rank).
    physical:                indices of the physical stages.
    key:                     the sweep's key (probe streams derive from it).
    loss_scale:              the microbatch's share of the loss (``n_j / n`` for a mean).
    exact_trace:             ``exact_trace(chain) -> records``: the adjoint trace (L down to 0) of
                             an exact sweep of ``chain`` (same stage count) on this microbatch;
                             the oracle forms use it (``None`` on a pipeline rank).
    meter:                   counts the rows and calls of each physical stage against the step's
                             budget: ``meter.charge(i, rows, kind)`` before running stage i on
                             ``rows`` rows (``kind``: forward_calls, jvp_calls, backward_calls).
    run:                     ``run(i, params, h)``: stage i's output as the sweep's forward computed
                             it (a digital stage's RNG state replayed, so its dropout masks repeat;
                             under the sweep's autocast); ``None``: the stage called plainly.
    feed:                    ``feed(i, out)``: stage i's output as the forward fed it to stage i+1
                             (rounded to the boundary dtype); ``None``: as is.
    drawn:                   the digital stages whose forward drew random numbers (``run`` replays them).
    state:                   ``state(i)``: stage i's input as the sweep's forward measured it (a physical
                             stage's inputs and everything downstream of one are the black box's), from
                             the tape: every stage of the range in ``prepare``, until the reverse fold
                             hands the stage's entry out; ``None`` where no tape is at hand.
    first:                   the sweep's number of stage 0 (a physical module cut at run time is a
                             one-stage problem, its call numbered as a chain of the cut modules numbers
                             its stages): probe streams derive from ``first + i``.
    checks:                  what the physical stages returned on the probe calls, counted on the
                             device (``physical.ProbeChecks``), refused by ``checked()`` after each
                             estimate if not finite; ``None``: nothing checked.
    """

    chain: Chain
    params: tuple[Any, ...]
    buffers: tuple[Any, ...]
    x: Any
    loss_args: tuple[Any, ...] | None
    physical: tuple[int, ...]
    key: int
    loss_scale: float
    exact_trace: Callable[[Chain], tuple[Any, ...]] | None = None
    meter: Any = None
    run: Callable[[int, Any, Any], Any] | None = None
    feed: Callable[[int, Any], Any] | None = None
    drawn: frozenset[int] = frozenset()
    state: Callable[[int], Any] | None = None
    first: int = 0
    checks: Any = None

    def checked(self) -> None:
        """Raise if a physical stage returned a non-finite value on a probe call since the last check."""
        if self.checks is not None:
            self.checks.check()

    def call(self, i: int, params: Any, h: Any) -> Any:
        """Stage i on ``h`` at ``params`` as the forward ran it (its buffer updates discarded)."""
        if self.run is not None:
            return self.run(i, params, h)
        return self.chain.stages[i].call(params, self.buffers[i], h)[0]

    def fed(self, i: int, out: Any) -> Any:
        """Stage i's output ``out`` as the next stage runs on it."""
        return out if self.feed is None else self.feed(i, out)

    def probe_seed(self, i: int, stream: str = "input") -> int:
        """The seed of stage i's probes for this sweep's key: ``"input"`` directions (zbp's, np's and
        direct's) or ``"params"`` directions (fd parameter probing). ``probes.chunks(seed, ...)``
        draws from it the very probes those estimators draw."""
        if stream not in STREAMS:
            raise ValueError(f"Problem.probe_seed: stream must be one of {tuple(STREAMS)}, got {stream!r}")
        return probe_seed(self.key, self.first + i, STREAMS[stream])

    def charge(self, i: int, rows: int, kind: str = "forward_calls") -> None:
        """Count a call of stage i on ``rows`` rows (raises, before it runs, past the budget)."""
        if self.meter is not None:
            self.meter.charge(i, rows, kind)
