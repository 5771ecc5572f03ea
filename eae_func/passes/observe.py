"""Observation: summary statistics of the costate into ``meta`` and into Python logging."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..adjoint import AdjointState
from ..lazy import Lazy
from .base import Pass, stateless, valued

__all__ = ["costate_statistics", "log", "stats"]


_FIELDS = ("mean", "std", "min", "max", "norm")


def costate_statistics(adj: AdjointState) -> dict[Any, Any]:
    """mean, std (population), min, max, 2-norm, numel, has_nan, has_inf over all the costate's
    entries, in float32 (as eae-runtime's ``AdjointState.statistics``); read lazily, all by one
    transfer when the first is used."""
    tensors = [t.detach().reshape(-1).float() for t in adj.tensors()]
    flat = torch.cat(tensors) if len(tensors) > 1 else tensors[0] if tensors else torch.zeros(0)
    if flat.numel() == 0:
        return dict(dict.fromkeys(_FIELDS, float("nan")), norm=0.0, numel=0, has_nan=False, has_inf=False)
    summary = Lazy.each(
        torch.stack(
            [
                flat.mean(),
                flat.std(unbiased=False),
                flat.min(),
                flat.max(),
                torch.linalg.vector_norm(flat),
                torch.isnan(flat).any().float(),
                torch.isinf(flat).any().float(),
            ]
        )
    )
    return dict(
        zip(_FIELDS, summary[:5]),
        numel=flat.numel(),
        has_nan=Lazy(lambda: bool(summary[5])),
        has_inf=Lazy(lambda: bool(summary[6])),
    )


@valued
def stats() -> Pass:
    """Record ``costate_statistics`` in ``meta`` (so they reach ``res.stats["boundaries"][l]``)."""

    def stats_pass(adj: AdjointState) -> AdjointState:
        return adj.applied("stats", adj.value, **costate_statistics(adj))

    return stateless(stats_pass, "stats()")


@valued
def log(logger: logging.Logger | str | None = None, level: int | str = logging.INFO) -> Pass:
    """Emit ``costate_statistics`` of every boundary through Python logging, one record per
    boundary, the fields in ``record.eae`` (``extra={"eae": {...}}``: index, stage, history and
    the statistics). Costs nothing when ``logger`` is not enabled for ``level``. The numbers are
    lazy: the pass reads nothing off the device; a handler that formats the record reads them
    (all fields by one transfer)."""
    if logger is None or isinstance(logger, str):
        logger = logging.getLogger(logger or "eae_func.passes")
    elif not isinstance(logger, logging.Logger):
        raise TypeError(f"log: logger must be a logging.Logger, a logger name or None, got {type(logger).__name__}")
    if isinstance(level, str):
        name = level
        level = logging.getLevelName(name.upper())
        if not isinstance(level, int):
            raise ValueError(f"log: unknown level {name!r}, expected a logging level name or int")

    def log_pass(adj: AdjointState) -> AdjointState:
        if logger.isEnabledFor(level):
            fields = costate_statistics(adj)
            logger.log(
                level,
                "eae costate at boundary %d (%s): norm=%.4g mean=%.4g std=%.4g nan=%s inf=%s",
                adj.index,
                adj.stage,
                fields["norm"],
                fields["mean"],
                fields["std"],
                fields["has_nan"],
                fields["has_inf"],
                extra={"eae": dict(index=adj.index, stage=adj.stage, history=adj.history, **fields)},
            )
        return adj.applied("log", adj.value)

    return stateless(log_pass, "log()")
