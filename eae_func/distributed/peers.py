"""What the ranks of a pipeline tell each other beside the schedule's own transfers (``Pipeline``'s,
as a mixin): the plan before the first step; each step's options, agreed by a digest every step
and gathered only when a digest differs from the last agreement's; the loss, from the last rank;
and the partial sums of tied gradients whose uses span ranks, added in rank order."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import optree
import torch
import torch.distributed as dist

from ..core import microbatch as M
from ..core.options import Options
from ..core.ties import tie_grads
from ..program.chain import Chain
from ..tree import NAMESPACE
from .codecs import Codec
from .data_parallel import digest
from .launch import PeerError

__all__ = ["OWN", "Agreement", "Peers", "Tied"]

OWN = ("inputs", "loss_args", "frozen")  # what a rank tells the others about its own share (not compared)


@dataclasses.dataclass
class Agreement:
    """What the ranks agreed on for a step, kept while every rank's options keep their digest.

    digests:    each rank's 32-byte options digest, in pipeline order (a ``(p, 32)`` uint8 tensor).
    everyone:   each rank's options as gathered (the first rank's microbatch shapes among them).
    loss_dtype: the loss's dtype, learnt on the first step (``None`` before it).
    presence:   per ``(boundary, microbatch)``, which leaves of the costate crossing it carry one,
                learnt on the first step.
    tied:       per tied group that spans ranks, its ``Tied``, learnt on the first step (``None`` before it).
    """

    digests: torch.Tensor
    everyone: list[Any]
    loss_dtype: torch.dtype | None = None
    presence: dict[Any, Any] = dataclasses.field(default_factory=dict)
    tied: dict[Any, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Tied:
    """A tied group whose uses sit on several ranks, as the first step of an agreement showed it: the
    positions of its owners, of those whose partial sum of its gradients is a tensor (not ``None``),
    and that tensor's shape and dtype."""

    owners: tuple[Any, ...]
    senders: tuple[Any, ...]
    shape: tuple[Any, ...] = ()
    dtype: torch.dtype | None = None

    @staticmethod
    def of(owners: tuple[Any, ...], partials: list[Any]) -> Tied:
        """From every rank's partial sum (``None`` where it has none or uses none), in pipeline order."""
        senders = tuple(k for k, t in enumerate(partials) if t is not None)
        if not senders:
            return Tied(owners, senders)
        first = partials[senders[0]]
        return Tied(owners, senders, tuple(first.shape), first.dtype)


def _shapes(trees: list[Any]) -> list[Any]:
    """Per tree, the shapes and dtypes of its tensor leaves."""
    return [
        [
            [list(t.shape), str(t.dtype)]
            for t in optree.tree_leaves(tree, namespace=NAMESPACE)
            if isinstance(t, torch.Tensor)
        ]
        for tree in trees
    ]


class Peers:
    """One rank's exchanges with the other ranks of its pipeline: what it reads of the pipeline are
    its chain, ranks, position, stage ranges and stages, groups, timeout and device."""

    chain: Chain
    rank: int
    ranks: tuple[Any, ...]
    position: int
    ranges: tuple[Any, ...]
    owned: tuple[Any, ...]
    stages: tuple[Any, ...]
    schedule: str
    group: Any
    host_group: Any
    timeout: float
    device: torch.device
    agreement: Agreement | None
    costate_codec: Codec
    boundary_codec: Codec

    def plan(self) -> dict[Any, Any]:
        """What every rank of the pipeline must agree on: ranks, stage ranges, schedule, codecs and
        the chain's structure (stage names; a module stage's parameter names, shapes and dtypes)."""

        def structure(s):
            if s.module is None:
                return [s.name, s.physical]
            return [s.name, s.physical, [[n, list(t.shape), str(t.dtype)] for n, t in s.module.named_parameters()]]

        return {
            "ranks": list(self.ranks),
            "ranges": [list(r) for r in self.ranges],
            "schedule": self.schedule,
            "costate_codec": self.costate_codec.name,
            "boundary_codec": self.boundary_codec.name,
            "stages": [structure(s) for s in self.chain.stages],
        }

    def _agree(self) -> None:
        differences = self._differences(self._gather(self.plan(), "the plan", self.host_group))
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline disagree before "
                f"the first step; give every rank the same chain, ranges, schedule and codecs: "
                + "; ".join(differences)
            )

    def _agree_on_step(self, opts: Options, groups: list[Any], pieces: list[Any]) -> Agreement:
        """The ranks' agreement on this step's options, the tied tensors found in params and (from the
        first and last ranks) the microbatches' shapes; ``PeerError`` naming what differs: a rank with
        another key, an extra pass or another boundary dtype would compute gradients no single sweep
        gives. Every step all_gathers each rank's digests of its options and of its key (which may
        change every step without a new agreement); the options themselves are gathered only when a
        digest differs from the last agreement's (on the first step too), so every rank takes the
        same path."""
        mine = self._step_options(opts, groups, pieces)
        row = torch.cat([digest({k: v for k, v in mine.items() if k != "key"}), digest(opts.key)])
        rows = self._gather_digests(row)
        agreed, p = self.agreement, len(self.ranks)
        if (
            agreed is not None
            and torch.equal(rows[:, :32], agreed.digests)
            and torch.equal(rows[:, 32:], row[32:].expand(p, -1))
        ):
            return agreed
        everyone = self._gather(mine, "the options", self.host_group)
        differences = self._differences([{k: v for k, v in theirs.items() if k not in OWN} for theirs in everyone])
        if differences:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): the ranks of the pipeline were given different "
                f"options for this step; give every rank the same Pipeline.sweep options (and the whole params, "
                f"or chain.ties, for tensors shared across ranks): " + "; ".join(differences)
            )
        self.agreement = Agreement(rows[:, :32], everyone)
        return self.agreement

    def _step_options(self, opts: Options, groups: list[Any], pieces: list[Any]) -> dict[Any, Any]:
        """What this rank says about a step: its options and tied tensors, the shapes of its
        microbatches' inputs (the first rank: the others receive into buffers of their shapes) or
        loss args (the last rank: with its options, they fix the loss's dtype), and which of its uses
        of tied tensors are frozen (with its options, whether its partial sums are ``None``)."""
        k = self.position
        return {
            "key": opts.key,
            "microbatches": opts.microbatches,
            "reduction": opts.reduction,
            "passes": opts.passes.describe(),
            "boundary_dtype": str(opts.boundary_dtype),
            "autocast": str(opts.autocast),
            "keep_costates": opts.keep_costates,
            "estimator": repr(opts.estimator),
            "physical": list(opts.physical),
            "ties": [[[i, list(map(str, path))] for i, path in group] for group in groups],
            "inputs": _shapes([mb.x for mb in pieces]) if k == 0 else None,
            "loss_args": _shapes([mb.loss_args for mb in pieces]) if k == len(self.ranks) - 1 else None,
            "frozen": self._frozen_ties(groups),
        }

    def _frozen_ties(self, groups: list[Any]) -> list[Any]:
        """This rank's uses ``[stage, path]`` of tied tensors that are frozen (``requires_grad=False``)."""
        used = {i for group in groups for i, _ in group if i in self.stages}
        frozen = {i: self.chain.stages[i].frozen() for i in used}
        return [
            [i, list(map(str, path))] for group in groups for i, path in group if i in used and path[0] in frozen[i]
        ]

    def _gather_digests(self, row: torch.Tensor) -> torch.Tensor:
        """Every pipeline rank's digest ``row`` (host memory), stacked in pipeline order."""
        everyone = [torch.empty_like(row) for _ in self.ranks]
        with self._exchanging("the options' digests"):
            dist.all_gather(everyone, row, group=self.host_group)
        return torch.stack(everyone)

    def _gather(self, mine: Any, what: str, group: Any) -> list[Any]:
        """Every pipeline rank's ``mine``, in pipeline order (pickled)."""
        everyone: list[Any] = [None] * len(self.ranks)
        with self._exchanging(what):
            dist.all_gather_object(everyone, mine, group=group)
        return everyone

    @contextlib.contextmanager
    def _exchanging(self, what: str):
        """Turn a failed collective into ``PeerError`` naming this rank and ``what`` it exchanged."""
        try:
            yield
        except RuntimeError as e:
            raise PeerError(
                f"rank {self.rank} ({self.where(self.rank)}): exchanging {what} failed within the timeout "
                f"({self.timeout:g} s); a peer died, stalled or is not in this pipeline: {e}"
            ) from e

    def _differences(self, everyone: list[Any]) -> list[Any]:
        mine = everyone[self.position]
        return [
            f"{key}: {mine[key]} here, {theirs.get(key)} on rank {rank}"
            for rank, theirs in zip(self.ranks, everyone)
            for key in mine
            if mine[key] != theirs.get(key)
        ]

    def where(self, rank: int) -> str:
        """``"stages 2-3 ('b2'..'b3')"``: what global ``rank`` runs in this pipeline."""
        if rank not in self.ranks:
            return "not in this pipeline"
        p = len(self.ranks)
        return ", ".join(self._range_name(r) for r in range(self.ranks.index(rank), len(self.ranges), p))

    def _neighbours(self) -> str:
        """The ranks this one exchanges boundaries with, and what they run."""
        p = len(self.ranks)
        peers = sorted(
            {(r + d) % p for r in self.owned for d in (-1, 1) if 0 <= r + d < len(self.ranges)} - {self.position}
        )
        return "; ".join(f"rank {self.ranks[k]}: {self.where(self.ranks[k])}" for k in peers)

    def _range_name(self, r: int) -> str:
        lo, hi = self.ranges[r]
        names = self.chain.names
        return (
            f"stage {lo} ({names[lo]!r})"
            if hi - lo == 1
            else f"stages {lo}-{hi - 1} ({names[lo]!r}..{names[hi - 1]!r})"
        )

    def _share_loss(self, loss: torch.Tensor | None, agreement: Agreement) -> torch.Tensor:
        """The last rank's summed loss (a scalar), on every rank: broadcast as a tensor of the dtype
        the first step with this agreement learnt, when it crossed pickled."""
        last = self.ranks[-1]
        with self._exchanging(f"the loss from rank {last}"):
            if agreement.loss_dtype is None:
                held: list[Any] = [loss]
                dist.broadcast_object_list(held, src=last, group=self.group)
                agreement.loss_dtype = held[0].dtype
                return held[0].to(self.device)
            if loss is None:
                loss = torch.empty((), dtype=agreement.loss_dtype, device=self.device)
            elif loss.dtype != agreement.loss_dtype:
                raise ValueError(
                    f"Pipeline.sweep: rank {self.rank}'s loss is {loss.dtype} this step, {agreement.loss_dtype} on "
                    f"the first step with the same options and loss args, and the other ranks receive it as that; "
                    f"keep the loss's dtype, or make a new Pipeline"
                )
            loss = loss.to(self.device)
            dist.broadcast(loss, src=last, group=self.group)
            return loss

    def _tie(
        self, params: tuple[Any, ...], grads: tuple[Any, ...], groups: list[Any], agreement: Agreement
    ) -> tuple[Any, ...]:
        """Give every use of a tied tensor the sum of all uses' gradients (``ties.tie_grads``): each rank
        sums its own uses in order, and where a group spans ranks the partial sums (``_partials``) are
        added in rank order, so every owner holds bit-identical totals."""

        def combine(partial: dict[Any, Any]) -> dict[Any, Any]:
            parts = self._partials(partial, groups, agreement)
            return {n: functools.reduce(M.add, parts[n], None) for n in partial}

        return tie_grads(params, grads, groups, self.stages, combine)

    def _partials(self, partial: dict[Any, Any], groups: list[Any], agreement: Agreement) -> dict[Any, Any]:
        """Per tied group this rank uses, the owners' partial sums that are not ``None``, in rank order:
        its own where the group is this rank's alone; where it spans ranks, gathered pickled on the first
        step of the agreement (which learns ``agreement.tied``), later sent between the owners as
        tensors (``_swap_partials``)."""
        owners = [tuple(sorted({self._owner(i) for i, _ in group})) for group in groups]
        parts = {n: [p] if p is not None else [] for n, p in partial.items()}
        if all(len(o) == 1 for o in owners):
            return parts
        if agreement.tied is not None:
            return parts | self._swap_partials(partial, agreement.tied)
        everyone = self._gather(partial, "tied gradients", self.group)
        sent = [[theirs.get(n) for theirs in everyone] for n in range(len(groups))]
        agreement.tied = {n: Tied.of(o, sent[n]) for n, o in enumerate(owners) if len(o) > 1}
        return parts | {n: [t for t in sent[n] if t is not None] for n in partial if n in agreement.tied}

    def _swap_partials(self, partial: dict[Any, Any], tied: dict[Any, Any]) -> dict[Any, Any]:
        """The partial sums of the spanning groups this rank owns, sent point to point between their
        owners as tensors of the shape and dtype the first step learnt; a partial sum that is ``None``
        now and was not then (or the other way round) is refused."""
        ops, parts = [], {}
        for n, group in tied.items():
            if n not in partial:
                continue
            mine = partial[n]
            if (mine is not None) != (self.position in group.senders):
                raise ValueError(
                    f"Pipeline.sweep: rank {self.rank}'s gradient of a tied tensor is "
                    f"{'a tensor' if mine is not None else 'None'} this step, and was not on the first step with "
                    f"these options, which its other owners now expect without exchanging it pickled"
                )
            device = self.device if mine is None else mine.device
            parts[n] = [
                mine if k == self.position else torch.empty(group.shape, dtype=group.dtype, device=device)
                for k in group.senders
            ]
            peers = [(k, t) for k, t in zip(group.senders, parts[n]) if k != self.position]
            ops += [dist.P2POp(dist.irecv, t, self.ranks[k], self.group) for k, t in peers]
            if mine is not None:
                mine = mine.contiguous()
                ops += [
                    dist.P2POp(dist.isend, mine, self.ranks[k], self.group) for k in group.owners if k != self.position
                ]
        with self._exchanging("tied gradients"):
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
        return parts

    def _owner(self, stage: int) -> int:
        r = next(r for r, (lo, hi) in enumerate(self.ranges) if lo <= stage < hi)
        return r % len(self.ranks)
