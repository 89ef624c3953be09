"""Newton-Schulz of one matrix split over a team of ranks, for matrices too large for one owner to
keep the ranks balanced (``muon_plan.py`` gives such a unit a team of several ranks).

The iteration on the wide orientation X (s x l, s the short side) divides by column blocks: with
X = [X_1 ... X_k] over the team's k members, the Gram matrix is the sum of the blocks' X_j X_j^T
(each member sends its s x s part to the others and every member adds the k parts in team order,
so all hold the same G), the polynomial P = b G + c G G is computed by row blocks (one per member,
then exchanged), and each member updates its own block, X_j <- a X_j + P X_j. Every product of the
quintic is split k ways; the Frobenius norm that first scales X is the root of the blocks' summed
squares. The result equals the whole matrix's iteration up to the order of the sums (the parity
rule).

The blocks follow the shards: where the long side is the sharded dim, member j's block is the rows
of a run of consecutive shard holders (each holder sends its whole piece to one member); otherwise
the long side is cut evenly and each holder sends each member its piece's part of that block.
Orthogonalised blocks return the same way. All transfers are point-to-point in the shard group,
unit by unit in plan order and, within a unit, gathers, then the members' exchanges, then the
returns, so every pair of ranks posts its messages in the same order on both ends; only members
wait within a unit (a holder's waits come at the end), so teams of different units overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from veomni.optim.muon import ns_dtype

Span = tuple[int, int]
"""(start, length) along one matrix dim."""


@dataclass
class ShardedMatrix:
    """One matrix split over ``group`` (a 2-D update, or one expert of a stack): which output slot
    and expert, this rank's piece, along which dim."""

    slot: int
    expert: int | None
    """Index into the local stack of a 3-D tensor; None for a 2-D one."""
    local: Tensor
    dim: int
    """Matrix dim (0 rows, 1 columns) the group splits."""
    full: int
    """That dim's global size."""
    shape: tuple[int, int]
    group: dist.ProcessGroup


@dataclass(frozen=True)
class _Layout:
    """Where each part of a unit lies, in matrix coordinates: the holders' shards (``torch.chunk``
    counts along ``unit.dim``) and the members' blocks along the long side."""

    unit: ShardedMatrix
    ranks: int
    team: tuple[int, ...]

    @property
    def long_dim(self) -> int:
        """The long side of the wide orientation: rows of a tall matrix, else columns."""
        return 0 if self.unit.shape[0] > self.unit.shape[1] else 1

    def shard(self, rank: int) -> Span:
        chunk = -(-self.unit.full // self.ranks)
        start = min(rank * chunk, self.unit.full)
        return start, min(chunk, self.unit.full - start)

    def block(self, member: int) -> Span:
        k, length = len(self.team), self.unit.shape[self.long_dim]
        if self.long_dim == self.unit.dim:  # the shards of a run of consecutive holders
            per = -(-self.ranks // k)
            start = self.shard(member * per)[0] if member * per < self.ranks else length
            end = self.shard(min((member + 1) * per, self.ranks) - 1)
            return start, max(0, sum(end) - start)
        return member * length // k, (member + 1) * length // k - member * length // k

    def region(self, rank: int, member: int) -> tuple[Span, Span] | None:
        """The spans (rows, columns) that holder ``rank``'s shard shares with ``member``'s block."""
        spans = [(0, self.unit.shape[0]), (0, self.unit.shape[1])]
        spans[self.long_dim] = self.block(member)
        shard, span = self.shard(rank), spans[self.unit.dim]
        lo, hi = max(span[0], shard[0]), min(sum(span), sum(shard))
        spans[self.unit.dim] = (lo, hi - lo)
        return (spans[0], spans[1]) if spans[0][1] > 0 and spans[1][1] > 0 else None

    def origin(self, span: Span, dim: int) -> tuple[int, int]:
        """Matrix coordinates of element [0, 0] of a tensor cut at ``span`` along ``dim``."""
        return (span[0], 0) if dim == 0 else (0, span[0])


def _cut(tensor: Tensor, spans: tuple[Span, Span], origin: tuple[int, int]) -> Tensor:
    """The part of ``tensor`` (its [0, 0] at ``origin``) at ``spans``."""
    (r0, rows), (c0, cols) = spans
    return tensor[r0 - origin[0]:r0 - origin[0] + rows, c0 - origin[1]:c0 - origin[1] + cols]


class _Mail:
    """Point-to-point messages in one shard group; a message to oneself is handed over in memory."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg, self.me = pg, dist.get_rank(pg)
        self.sent: list[Any] = []
        self.to_self: dict[Any, Tensor] = {}

    def send(self, tensor: Tensor, peer: int, key: Any = None) -> None:
        """``key`` names a message to oneself (the receive that takes it gives the same)."""
        if peer == self.me:
            self.to_self[key] = tensor
        else:
            self.sent.append(dist.isend(tensor, group=self.pg, group_dst=peer))

    def recv(self, buffer: Tensor, peer: int, key: Any = None) -> Any:
        """A handle whose ``wait()`` returns the message (in ``buffer`` unless sent to oneself)."""
        if peer == self.me:
            return _Delivered(self.to_self, key)
        return _Pending(dist.irecv(buffer, group=self.pg, group_src=peer), buffer)

    def exchange(self, mine: Tensor, team: tuple[int, ...], shapes: list[tuple[int, ...]]) -> list[Tensor]:
        """Every member's tensor (``mine`` among them), in team order."""
        handles = [None if peer == self.me else self.recv(mine.new_empty(shape), peer)
                   for peer, shape in zip(team, shapes)]
        for peer in team:
            if peer != self.me:
                self.send(mine, peer)
        return [mine if handle is None else handle.wait() for handle in handles]

    def finish(self) -> None:
        for work in self.sent:
            work.wait()


@dataclass
class _Pending:
    work: Any
    buffer: Tensor

    def wait(self) -> Tensor:
        self.work.wait()
        return self.buffer


@dataclass
class _Delivered:
    box: dict[Any, Tensor]
    key: Any

    def wait(self) -> Tensor:
        return self.box.pop(self.key)


def split_orthogonalize(units: list[tuple[ShardedMatrix, tuple[int, ...]]], group: dict[str, Any]) -> list[Tensor]:
    """This rank's piece of each unit's orthogonalised matrix (``units``: each with its team, all
    in one shard group, in plan order)."""
    if not units:
        return []
    mail = _Mail(units[0][0].group)
    returns = []
    for number, (unit, team) in enumerate(units):
        gather, back = ("gather", number), ("return", number)
        layout = _Layout(unit, dist.get_world_size(unit.group), team)
        mine = layout.shard(mail.me)
        shard_origin = layout.origin(mine, unit.dim)
        member = team.index(mail.me) if mail.me in team else None
        inbox = []
        if member is not None:
            regions = [(rank, layout.region(rank, member)) for rank in range(layout.ranks)]
            inbox = [(rank, spans, mail.recv(unit.local.new_empty(spans[0][1], spans[1][1]), rank, gather))
                     for rank, spans in regions if spans is not None]
        for index, peer in enumerate(team):
            spans = layout.region(mail.me, index)
            if spans is not None:
                mail.send(_cut(unit.local, spans, shard_origin).contiguous(), peer, gather)
        if member is not None:
            block_span = layout.block(member)
            shape = list(unit.shape)
            shape[layout.long_dim] = block_span[1]
            block = unit.local.new_empty(shape)
            block_origin = layout.origin(block_span, layout.long_dim)
            for _, spans, handle in inbox:
                _cut(block, spans, block_origin).copy_(handle.wait())
            ortho = _team_newton_schulz(block, layout, mail, group).to(block.dtype)
            for rank, spans, _ in inbox:
                mail.send(_cut(ortho, spans, block_origin).contiguous(), rank, back)
        parts = []
        for index, peer in enumerate(team):
            spans = layout.region(mail.me, index)
            if spans is not None:
                parts.append((spans, mail.recv(unit.local.new_empty(spans[0][1], spans[1][1]), peer, back)))
        returns.append((unit, shard_origin, parts))
    pieces = []
    for unit, shard_origin, parts in returns:
        piece = torch.empty_like(unit.local)
        for spans, handle in parts:
            _cut(piece, spans, shard_origin).copy_(handle.wait())
        pieces.append(piece)
    mail.finish()
    return pieces


def _team_newton_schulz(block: Tensor, layout: _Layout, mail: _Mail, group: dict[str, Any]) -> Tensor:
    """This member's block of the orthogonalised matrix (``newton_schulz`` with its column blocks
    of X over the team; see the module docstring)."""
    a, b, c = group["ns_coefficients"]
    team, tall = layout.team, layout.long_dim == 0
    x = block.to(ns_dtype(group["ns_dtype"], block.device))
    if tall:
        x = x.T
    short = x.shape[0]
    squares = mail.exchange(torch.linalg.vector_norm(x, dtype=torch.float32).square().reshape(1), team,
                            [(1,)] * len(team))
    norm = sum(squares[1:], squares[0]).sqrt().to(x.dtype)
    x = x / norm.clamp(min=group["eps"])
    rows = [(j * short // len(team), (j + 1) * short // len(team)) for j in range(len(team))]
    lo, hi = rows[team.index(mail.me)]
    for _ in range(group["ns_steps"]):
        grams = mail.exchange(x @ x.T, team, [(short, short)] * len(team))
        gram = sum(grams[1:], grams[0])
        poly_rows = torch.addmm(gram[lo:hi], gram[lo:hi], gram, beta=b, alpha=c)
        poly = torch.cat(mail.exchange(poly_rows, team, [(end - start, short) for start, end in rows]))
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x
