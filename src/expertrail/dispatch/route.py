"""Routes: the linear maps that carry rows from tokens to expert rows and back.

Every backend moves data the same way, only the steps differ. A `Route` is a list of `Hop`s:
each hop gathers rows of the previous level (a row may be taken several times: one copy per
destination) and, for a communicating hop, exchanges them with one all-to-all (or all-gather).
The last hop is local: it expands the received rows into expert-major rows, with padding.

Dispatch applies the hops forward. Combine applies their transpose: each hop's all-to-all
runs backwards and the copies of a row are summed back into it, in fp32 and in a fixed copy
order, so results are reproducible bit for bit. The autograd of dispatch is combine's
transpose and vice versa, so gradients need no extra code per backend.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from .. import kernels
from ..kernels.torch_ops import CopyPositions, count_values, reduce_copies_of, stable_argsort, summing_table
from ..comm.topology import guarded
from ..comm.transport import (MIN_PIECE_ROWS, Channel, LandingRuns, PieceSends, Transfer, TransferStats,
                              concat_transfers, later, link_class)
from ..kernels.workspace import Workspace, allocate, allocate_zeros


_trace: list | None = None


@contextlib.contextmanager
def tracing():
    """Record when the pieces of a pipelined route land and move on: yields a list that fills
    with (time.perf_counter(), event) pairs (benchmarks/pipeline_trace.py draws one call)."""
    global _trace
    outer, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = outer


def _note(event: str) -> None:
    if _trace is not None:
        _trace.append((time.perf_counter(), event))


def number_copies(index: torch.Tensor, num_src: int, max_copies: int) -> tuple[torch.Tensor, CopyPositions]:
    """For a gather ``index [R]`` of ``num_src`` source rows: the copy of each copy (its rank
    among the copies of its source row, in order of appearance: the fixed order in which they
    are summed back), int64 [R], and the `CopyPositions` of those copies, both from one stable
    sort (the sort that numbers the copies also lists them by source row, in copy order)."""
    order = stable_argsort(index)
    offsets = torch.zeros(num_src + 1, dtype=torch.int64, device=index.device)
    torch.cumsum(count_values(index, num_src), 0, out=offsets[1:])
    source = index.index_select(0, order)
    ranked = torch.arange(index.numel(), device=index.device) - offsets.index_select(0, source)
    copy = torch.empty_like(index).scatter_(0, order, ranked)
    return copy, CopyPositions(num_src, max_copies, index=index, copy=copy, bags=(order, ranked, source, offsets))


@dataclass(kw_only=True)
class Hop:
    """What every hop is: copies of the previous level's rows, and their sum back.

    index:  int64 [R] row of the previous level that each of this hop's R rows copies
    copy:   int64 [R] which copy of its source row it is, in [0, max_copies): the order in which
            copies are summed back
    num_src: rows of the previous level; max_copies: most copies of one source row
    positions: the `CopyPositions` of ``index`` / ``copy`` when the planner has them at hand
        (built from them on first use otherwise)

    The kinds: `ExpandHop` and `InPlaceHop` (local: the last hop, into the padded expert-major
    output), `AllToAllHop`, `LandingHop` (an all-to-all whose rows land in place) and
    `AllGatherHop` (exchanging), and `SplitHop` (an all-to-all in two parts, pipelined).
    """

    index: torch.Tensor
    copy: torch.Tensor
    num_src: int
    max_copies: int
    positions: CopyPositions | None = None

    communicates = False

    @classmethod
    def numbered(cls, index: torch.Tensor, num_src: int, most_copies: int, **fields) -> "Hop":
        """The hop whose j-th row copies row ``index[j]`` of a level of ``num_src`` rows (at most
        ``most_copies`` copies of one row), the copies of a row numbered in order of appearance
        (`number_copies`); ``fields``: those of the hop's kind."""
        copy, positions = number_copies(index, num_src, max(1, most_copies))
        return cls(index=index, copy=copy, num_src=num_src, max_copies=positions.max_copies, positions=positions,
                   **fields)

    def copies(self) -> CopyPositions:
        """Where each source row's copies sit among the rows of this hop (cached)."""
        if self.positions is None:
            self.positions = CopyPositions.build(self.index, self.copy, self.num_src, self.max_copies)
        return self.positions

    def reduce(self, rows: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """rows [R, C] -> [num_src, C]: each source row's copies summed in fp32 in copy order,
        each scaled by ``weights [R]`` first when given."""
        return kernels.reduce_copies(rows, self.copies(), weights, out_dtype)

    def add_stats(self, stats: TransferStats, payload_bytes: int, my_rank: int, domain_size: int,
                  backward: bool = False) -> None:
        """Count the rows this hop sends (a local hop sends none)."""


@dataclass(kw_only=True)
class ExpandHop(Hop):
    """The last hop: the received rows copied into expert-major output rows.

    out_pos / out_rows: where each row lands in the padded output of ``out_rows`` rows (None:
    no padding, row j is output row j)
    """

    out_pos: torch.Tensor | None = None
    out_rows: int | None = None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """[num_src, C] -> the padded output [M, C] (zeros on padding)."""
        return kernels.copy_rows(rows, self.index, self.out_rows or self.index.numel(), self.destinations,
                                 zero_rows=self.padding_rows, place=self.place)

    def place(self, rows: torch.Tensor) -> torch.Tensor:
        """Real output rows [M_real, ...] -> padded output [M, ...] (zeros on padding)."""
        if self.out_pos is None:
            return rows
        out = allocate_zeros((self.out_rows, *rows.shape[1:]), rows.dtype, rows.device)
        return out.index_copy_(0, self.out_pos, rows)

    def real_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Padded output rows [M, ...] -> the real ones [M_real, ...]."""
        return rows if self.out_pos is None else rows.index_select(0, self.out_pos)

    def destinations(self) -> torch.Tensor:
        """int64 [num_src, max_copies]: output row of each copy of each source row (-1: none)."""
        if getattr(self, "_destinations", None) is None:
            dense = self.copies().dense()
            if self.out_pos is not None:
                dense = torch.where(dense >= 0, self.out_pos[dense.clamp(min=0)], dense)
            self._destinations = dense
        return self._destinations

    def padding_rows(self) -> torch.Tensor | None:
        """Output rows that no copy fills (alignment / capacity padding)."""
        if self.out_pos is None:
            return None
        if getattr(self, "_padding", None) is None:
            filled = torch.zeros(self.out_rows, dtype=torch.bool, device=self.out_pos.device)
            filled[self.out_pos] = True
            self._padding = torch.nonzero(~filled).squeeze(1)
        return self._padding

    def transpose(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Output rows [M, C] -> [num_src, C]: copies summed (fp32) per received row, each
        scaled by ``weights [M]`` first when given (combine's expert side)."""
        weights = None if weights is None else self.real_rows(weights)
        return self.reduce(self.real_rows(rows), weights, out_dtype or rows.dtype)

    # Streaming, for a level that lands (dispatch) or leaves (combine) in parts: a `SplitHop`'s.
    @property
    def streams(self) -> bool:
        """Whether `forward_parts` / `transpose_part` serve this hop's rows: on the CPU, where
        each part is a few row copies and sums (on a GPU one kernel takes every row in one
        launch, without the host reading the parts' bounds)."""
        return self.index.device.type == "cpu" and not kernels.use_triton(self.index)

    def forward_parts(self, level) -> torch.Tensor:
        """`forward` of a level that lands in parts (``level.parts``: (start, end, Transfer) of its
        rows, tiling them in landing order): each part is copied into its output rows as soon as
        it has landed, while the later parts are still on their way. Same output as
        ``forward(level.wait())``."""
        out = None
        runs = self._runs([(a, b) for a, b, _ in level.parts])
        for i, ((_, _, part), part_runs) in enumerate(zip(level.parts, runs)):
            rows = part.wait()
            if out is None:
                out = allocate((self.out_rows or self.index.numel(), *rows.shape[1:]), rows.dtype, rows.device)
            for first, index in part_runs:
                torch.index_select(rows, 0, index, out=out[first:first + index.numel()])
            _note(f"expansion: part {i} of {len(level.parts)} in place")
        level.wait()
        if self.out_pos is not None:
            out.index_fill_(0, self.padding_rows(), 0)
        return out

    def _runs(self, parts: list) -> list:
        """For each part (start, end) of the source rows: the runs of consecutive output rows that
        copy its rows, as (first output row, int64 [run] source rows counted from ``start``).
        Expert-major rows sorted by source then token make a few runs per part and expert."""
        key = tuple(parts)
        if getattr(self, "_parts_runs", (None,))[0] != key:
            index, m = self.index, self.index.numel()
            starts = torch.tensor([a for a, _ in parts], dtype=torch.int64, device=index.device)
            part = torch.bucketize(index, starts, right=True) - 1
            dest = self.out_pos if self.out_pos is not None else torch.arange(m, device=index.device)
            relative = index - starts[part]
            cut = torch.ones(m, dtype=torch.bool, device=index.device)
            cut[1:] = (part[1:] != part[:-1]) | (dest[1:] != dest[:-1] + 1)
            bounds = torch.nonzero(cut).squeeze(1).tolist() + [m]
            runs = [[] for _ in parts]
            for a, b, p, first in zip(bounds, bounds[1:], part[bounds[:-1]].tolist(), dest[bounds[:-1]].tolist()):
                runs[p].append((first, relative[a:b]))
            self._parts_runs = (key, runs)
        return self._parts_runs[1]

    def transpose_part(self, table: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype,
                       start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of `transpose`'s result [end - start, C], the same bits:
        ``table`` is the output rows [M, C] as `torch_ops.summing_table` gives them (widened
        once for all parts), ``weights [M]`` as `transpose` takes them."""
        return reduce_copies_of(table, self.copies(), weights, out_dtype, start, end, self.out_pos)


@dataclass(kw_only=True)
class InPlaceHop(ExpandHop):
    """The last hop after a `LandingHop`: the rows landed in their output places already.
    ``index`` lists the real output rows (``out_pos``, or all of them)."""

    streams = False

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def transpose(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if weights is None:
            return rows.to(out_dtype or rows.dtype)
        return super().transpose(rows, weights, out_dtype)


@dataclass(kw_only=True)
class AllToAllHop(Hop):
    """Gather the rows to send, then exchange them with one all-to-all over ``channel``.

    send_splits / recv_splits: rows per member of ``channel``, sent rows grouped by member
    peers: EP rank of each member (for link classes)
    meta_bytes: metadata bytes sent with each row on the way out (ids, weights, sources)
    me: this rank's index in ``channel``, when the rows it sends itself are gathered straight
        into place instead of through the send buffer (None: they go through it)
    pieces / piece_rows: each block travels in up to ``pieces`` pieces of at least ``piece_rows``
        rows (`transport.piece_bounds`), so that the next
        hop can forward each piece as it lands (`SplitHop`), and combine sends each piece back
        as soon as it is summed (gloo)
    """

    channel: Channel
    send_splits: list
    recv_splits: list
    peers: list
    meta_bytes: int = 0
    me: int | None = None
    pieces: int = 1
    piece_rows: int = MIN_PIECE_ROWS

    communicates = True
    kind = "all-to-all"

    def gather(self, rows: torch.Tensor, skip: tuple | None = None) -> torch.Tensor:
        """rows[index]: the rows this hop sends [R, C]; rows in ``skip = (start, end)`` may be
        left unfilled (a block the exchange puts in place itself)."""
        return kernels.copy_rows(rows, self.index, self.index.numel(), self.copies().dense, skip=skip)

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        """[num_src, C] -> the rows received [sum(recv_splits), C] (into ``out`` when given), or
        with ``async_op`` the `Transfer` bringing them. ``sent``: ``rows[index]`` when the
        caller gathered them already (this rank's own block may be unfilled)."""
        own = None if self.me is None else (rows, self.index)
        if sent is None:
            sent = self.gather(rows, self.own_block())
            own = None if kernels.use_triton(rows) else own   # the kernel wrote every row
        transfer = self.channel.all_to_all(sent, self.send_splits, self.recv_splits, own, out, pieces=self.pieces,
                                           piece_rows=self.piece_rows)
        return transfer if async_op else transfer.wait()

    def own_block(self) -> tuple | None:
        """(start, end) of the sent rows that stay on this rank, when they are gathered straight
        into place (see ``me``), else None."""
        return None if self.me is None else own_block(self.send_splits, self.me)

    def own_block_received(self) -> tuple:
        """(start, end) of the received rows that this rank sent itself."""
        return own_block(self.recv_splits, self.channel.rank)

    def send_meta(self, meta: torch.Tensor) -> Transfer:
        """Start sending int64 metadata rows [R, m], one per row this hop sends, the way the
        rows go (posted before them, so it lands first)."""
        return self.channel.all_to_all(meta, self.send_splits, self.recv_splits)

    def send_back(self, rows: torch.Tensor, own_later: bool = False) -> Transfer:
        """Start the reverse exchange. own_later: this rank's own block of ``rows`` is not
        computed yet; the caller writes it into the Transfer's ``own_rows`` before waiting
        (gloo only, see `Channel.all_to_all`)."""
        return self.channel.all_to_all(rows, self.recv_splits, self.send_splits, own_later=own_later)

    @property
    def can_fill_own_later(self) -> bool:
        return self.channel.gloo

    @property
    def sends_back_in_pieces(self) -> bool:
        return self.pieces > 1 and self.channel.gloo

    def send_back_pieces(self, like: torch.Tensor) -> PieceSends:
        """Start the reverse exchange piece by piece (``sends_back_in_pieces``): every piece
        coming back is posted now; the caller sends each of its own as it has it
        (`PieceSends.send`) and fills its own block in place. ``like``: rows of the dtype and
        width sent back."""
        out = allocate((sum(self.send_splits), *like.shape[1:]), like.dtype, like.device)
        return self.channel.pieces_back(out, self.recv_splits, self.send_splits, self.pieces, self.piece_rows)

    def reverse(self, back: Transfer, before: "AllToAllHop | None", dtype: torch.dtype, landed):
        """Combine's step through this hop: wait for the rows coming back (``back``, from
        `send_back`), call ``landed()`` (it returns the weights for the reduce, or None), sum the
        copies of each source row and start the reverse exchange of the hop ``before`` this one.
        Returns that Transfer, or the sums [num_src, C] when ``before`` is None."""
        rows = back.wait()
        summed = self.reduce(rows, landed(), dtype)
        return summed if before is None else before.send_back(summed)

    def transpose(self, rows: torch.Tensor) -> torch.Tensor:
        """Received rows -> [num_src, C], copies summed per source row (unweighted)."""
        return self.reverse(self.send_back(rows), None, rows.dtype, lambda: None)

    def add_stats(self, stats: TransferStats, payload_bytes: int, my_rank: int, domain_size: int,
                  backward: bool = False) -> None:
        """Count the rows this hop sends (forward, with metadata) or sends back (transpose)."""
        row_bytes = payload_bytes if backward else payload_bytes + self.meta_bytes
        for peer, count in zip(self.peers, self.recv_splits if backward else self._sent_per_member()):
            stats.add(link_class(my_rank, peer, domain_size), count, row_bytes)

    def _sent_per_member(self) -> list:
        return self.send_splits


@dataclass(kw_only=True)
class LandingHop(AllToAllHop):
    """An all-to-all whose received rows land straight in their final places (``runs``, a
    `LandingRuns`); the route's last hop is then an `InPlaceHop`."""

    runs: LandingRuns

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        if sent is None:
            sent = self.gather(rows, self.runs.local_block())
            if kernels.use_triton(rows):                  # the kernel wrote every row
                transfer = self.runs.exchange(sent, forward=True)
                return transfer if async_op else transfer.wait()
        transfer = self.runs.exchange(sent, forward=True, source=rows, index=self.index)
        return transfer if async_op else transfer.wait()

    def send_back(self, rows: torch.Tensor, own_later: bool = False) -> Transfer:
        return self.runs.exchange(rows, forward=False)

    @property
    def can_fill_own_later(self) -> bool:
        return False


@dataclass(kw_only=True)
class AllGatherHop(AllToAllHop):
    """Every member gets all of this rank's ``num_src`` rows (one all-gather); ``recv_splits``
    are the members' row counts. The reverse is an all-to-all of each member's partial sums."""

    kind = "all-gather"

    def send_meta(self, meta: torch.Tensor) -> Transfer:
        return self.channel.all_gather(meta, self.recv_splits)

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        transfer = self.channel.all_gather(rows, self.recv_splits)
        return transfer if async_op else transfer.wait()

    def _sent_per_member(self) -> list:
        return [max(self.recv_splits)] * len(self.peers)     # the all-gather sends padded rows


@dataclass
class Forwarded:
    """One piece of a `SplitHop`'s late part: rows ``[start, end)`` of the previous level,
    piece ``piece`` of the block received from member ``member`` of the previous hop's channel,
    forwarded by ``hop`` (whose ``index`` counts from ``start``)."""

    member: int
    piece: int
    start: int
    end: int
    hop: AllToAllHop


class _OneAhead:
    """Exchanges of a `SplitHop`'s late pieces, started in order and only when asked for
    (`upto`), so that each starts as late as its rows need and as early as its peers need:
    waiting for piece i first starts piece i + 1 (`landed`), so a rank never holds back a piece
    its domain peers wait for while it waits for theirs. ``started``: the Transfers so far."""

    def __init__(self, late: list):
        self.pieces, self.started = late, []

    def _start(self, i: int, piece: Forwarded) -> Transfer:
        raise NotImplementedError

    def upto(self, last: int) -> None:
        """Start every late piece's exchange up to ``last`` not started yet."""
        while len(self.started) <= min(last, len(self.pieces) - 1):
            i = len(self.started)
            self.started.append(self._start(i, self.pieces[i]))

    def landed(self, i: int) -> torch.Tensor:
        """Late piece ``i``'s rows, once landed; piece ``i + 1``'s exchange is started first."""
        self.upto(i + 1)
        return self.started[i].wait()


class _Forwarding(_OneAhead):
    """A `SplitHop`'s late pieces sent on, each once its piece of the previous level
    (``level``: rows, or the `Transfer` bringing them, with its ``pieces``) has landed; ``outs``:
    where each piece's exchange receives its rows."""

    def __init__(self, late: list, outs: list, level, own_rows: torch.Tensor):
        super().__init__(late)
        self.outs, self.level, self.own_rows = outs, level, own_rows
        in_flight = isinstance(level, Transfer)
        self.landing = {(a, b): t for a, b, t in getattr(level, "pieces", ())} if in_flight else {}

    def _start(self, i: int, piece: Forwarded) -> Transfer:
        if piece.end == piece.start:
            rows = self.own_rows[:0]
        elif (piece.start, piece.end) in self.landing:
            rows = self.landing[(piece.start, piece.end)].wait()
        else:
            rows = (self.level.wait() if isinstance(self.level, Transfer) else self.level)[piece.start:piece.end]
        if piece.end > piece.start:
            _note(f"rail piece {piece.piece} from domain {piece.member} landed")
        exchange = piece.hop.forward(rows, async_op=True, out=self.outs[i])
        if piece.end > piece.start:
            _note(f"domain hop: piece {piece.piece} from domain {piece.member} sent on")
        return exchange


class _Returning(_OneAhead):
    """A `SplitHop`'s reverse exchanges: the late pieces' in order, each once its rows are at
    hand (``rows``: all of them [level rows, C], or a function giving rows [start, end)), then
    early's. Early's rows go back to the ranks of this domain that sent them, which add them to
    rows that never cross the slow link again, so they go last."""

    def __init__(self, split: "SplitHop", rows):
        super().__init__(split.late)
        self.split = split
        self.bounds = [0, *accumulate(sum(h.recv_splits) for h in split.parts)]
        self.part = rows if callable(rows) else lambda a, b: rows[a:b]
        self._early = None

    def _start(self, i: int, piece: Forwarded) -> Transfer:
        exchange = piece.hop.send_back(self.part(self.bounds[i + 1], self.bounds[i + 2]))
        if piece.end > piece.start:
            _note(f"combine: piece {piece.piece} for domain {piece.member}, expert-side sums sent in the domain")
        return exchange

    def early(self, wait: bool = True) -> torch.Tensor | None:
        """Early's rows coming back, once landed (sent after every late piece); ``wait=False``:
        only send every part."""
        self.upto(len(self.split.late))
        if self._early is None:
            self._early = self.split.early.send_back(self.part(0, self.bounds[1]))
        return self._early.wait() if wait else None

    def wait_all(self) -> None:
        """Send and wait for every part (nothing left in flight)."""
        self.early()
        for transfer in self.started:
            transfer.wait()


class SplitHop:
    """A communicating hop sent as several exchanges, so that it starts before the hop before it
    has landed: the two-level route's pipeline, as in DeepEP's and Hybrid-EP's internode
    kernels, whose NVLink stage forwards rows while others are still crossing the NIC.

    early: forwards the rows of the previous level that this rank sent itself (its own block,
        rows ``own = (start, end)``), in place as soon as the previous exchange is posted; its
        ``index`` counts from ``start``
    late: `Forwarded` pieces, one per piece of every other member's block of the previous hop
        (which sends its blocks in pieces, `AllToAllHop.pieces`), each forwarded as soon as it
        lands, in this order (the same on every rank of the channel: the exchanges draw their
        tags in it)
    level_rows: rows of the previous level
    streamed: the next hop takes each part as it lands and combine sums and sends each part on
        its own, one ahead of the previous hop's pieces (`_Forwarding`, `_Returning`); for a
        pipeline over a slow link. Otherwise every late piece is forwarded, and every part sent
        back, at once (a level of a few rows pays for parts more than they hide).

    Rows are received early's first, then each late piece's. Combine runs the mirror image:
    the late pieces' rows go back first, and each piece's sums start back through the previous
    hop as soon as they are summed (`AllToAllHop.send_back_pieces`), while the others are still
    coming back.
    """

    communicates = True
    kind = "all-to-all"

    def __init__(self, early: AllToAllHop, late: list, own: tuple, level_rows: int, streamed: bool = True):
        if not late:
            raise ValueError("a split hop forwards pieces of other members' blocks: late is empty")
        self.early, self.late, self.own, self.level_rows = early, late, own, level_rows
        self.streamed = streamed

    @property
    def parts(self) -> list:
        return [self.early] + [f.hop for f in self.late]

    # One exchange's view, for stats and for the bench's bare collectives.
    channel = property(lambda self: self.early.channel)
    peers = property(lambda self: self.early.peers)
    meta_bytes = property(lambda self: self.early.meta_bytes)
    send_splits = property(lambda self: [sum(c) for c in zip(*(h.send_splits for h in self.parts))])
    recv_splits = property(lambda self: [sum(c) for c in zip(*(h.recv_splits for h in self.parts))])

    def forward(self, level, async_op: bool = False, sent=None):
        """The previous level's rows [num_src, C], or the `Transfer` bringing them -> the rows
        received [sum(recv_splits), C]: early's exchange is posted at once, each late piece's
        as soon as its piece of ``level`` has landed. The Transfer's ``parts`` lists (start,
        end, Transfer) of the received rows, early's then each late piece's, so that the next
        hop can take each part as it lands (`ExpandHop.forward_parts`). (``sent``: as other
        hops take it; a split hop is never a route's first.)"""
        start, end = self.own
        in_flight = isinstance(level, Transfer)
        own_rows = level.own_rows if in_flight and level.own_rows is not None else None
        if own_rows is None:
            own_rows = (level.wait() if in_flight else level)[start:end]
        sizes = [sum(h.recv_splits) for h in self.parts]
        out = allocate((sum(sizes), *own_rows.shape[1:]), own_rows.dtype, own_rows.device)
        outs = out.split_with_sizes(sizes)
        early = self.early.forward(own_rows, async_op=True, out=outs[0])
        _note("domain hop: own rows sent on")
        late = _Forwarding(self.late, outs[1:], level, own_rows)

        def early_landed():
            late.upto(0)
            return early.wait()
        # Each part is waited for one piece ahead (`_OneAhead`).
        landing = [later(early_landed)] + [later(lambda i=i: late.landed(i)) for i in range(len(self.late))]
        bounds = [0, *accumulate(sizes)]
        if not self.streamed:
            late.upto(len(self.late))

        def finish(rows):
            for part in landing:
                part.wait()
            if in_flight:       # the previous hop's own sends too (a gloo send dropped unwaited never completes)
                level.wait()
            return rows
        transfer = Transfer(out, then=finish)
        if self.streamed:
            transfer.parts = list(zip(bounds, bounds[1:], landing))
        return transfer if async_op else transfer.wait()

    def send_meta(self, meta: list) -> Transfer:
        """Metadata [early's, each late piece's], received in the rows' order."""
        return concat_transfers([part.send_meta(m) for part, m in zip(self.parts, meta)])

    def send_back(self, rows) -> "_Returning":
        """Start the reverse exchanges, part by part (`_Returning`). ``rows``: [sum(recv_splits),
        C], all sent at once; or a function giving rows [start, end) of them, called just before
        each part is sent (combine's expert-side sums), so that each part leaves as soon as it
        is summed and `reverse` sends a piece across the slow link while later parts are still
        being summed."""
        back = _Returning(self, rows)
        if self.streamed:
            back.upto(1 if callable(rows) else len(self.late))
        else:
            back.early(wait=False)
        return back

    def reverse(self, back: "_Returning", before: AllToAllHop | None, dtype: torch.dtype, landed):
        """See `AllToAllHop.reverse`; each late piece's sums start back through ``before`` as
        soon as they are summed (pieces), or once all are (one exchange)."""
        back.landed(0)
        try:
            weights = landed()
        except BaseException:
            back.wait_all()           # raise with nothing of this hop left in flight
            raise
        if weights is not None:
            raise ValueError("a split hop is never a route's first hop, whose reduce alone takes weights")
        start, end = self.own
        if before is not None and before.sends_back_in_pieces:
            pending = None
            for i, piece in enumerate(self.late):
                summed = piece.hop.reduce(back.landed(i), None, dtype)
                if pending is None:
                    pending = before.send_back_pieces(summed)
                pending.send(piece.member, piece.piece, summed)
                if piece.end > piece.start:
                    _note(f"combine: piece {piece.piece} for domain {piece.member} summed and sent back")
            own = self.early.reduce(back.early(), None, dtype)
            if pending is None:
                pending = before.send_back_pieces(own)
            pending.own_rows.copy_(own)
            return pending.transfer
        summed = None
        for i, piece in enumerate(self.late):
            rows = piece.hop.reduce(back.landed(i), None, dtype)
            if summed is None:                # every row is some piece's or the own block's
                summed = allocate((self.level_rows, *rows.shape[1:]), rows.dtype, rows.device)
            summed[piece.start:piece.end] = rows
        _note("combine: every piece summed")
        if before is not None and before.can_fill_own_later:
            pending = before.send_back(summed, own_later=True)
            pending.own_rows.copy_(self.early.reduce(back.early(), None, dtype))
            return pending
        summed[start:end] = self.early.reduce(back.early(), None, dtype)
        return summed if before is None else before.send_back(summed)

    transpose = AllToAllHop.transpose

    def add_stats(self, stats: TransferStats, payload_bytes: int, my_rank: int, domain_size: int,
                  backward: bool = False) -> None:
        for part in self.parts:
            part.add_stats(stats, payload_bytes, my_rank, domain_size, backward)


@dataclass(frozen=True)
class Exchange:
    """One exchange of a route as the bench and profilers see it (`Route.exchanges`).

    kind: "all-to-all" or "all-gather"; channel: its `Channel`; peers: EP rank of each member;
    send_splits / recv_splits: rows per member on the way out (dispatch; combine sends them
    back); meta_bytes: metadata bytes beside each dispatched row; lands_in_place: the rows land
    straight in their final places (`LandingRuns`).
    """

    kind: str
    channel: Channel
    peers: list
    send_splits: list
    recv_splits: list
    meta_bytes: int
    lands_in_place: bool


def own_block(send_splits: list, me: int) -> tuple:
    """(start, end) of the block sent to peer ``me`` among rows laid out peer by peer."""
    start = sum(send_splits[:me])
    return start, start + send_splits[me]


@dataclass
class Stage:
    """One step of a route's plan: a hop, and the int64 metadata rows it sends beside its rows
    (one per row it sends; for a `SplitHop` a list, early's then late's; None: none)."""

    hop: object
    meta: torch.Tensor | list | None = None


@dataclass
class ExpertRows:
    """What a route's plan says of its expert rows at the end: row_k int64 [M_real], the top-k
    copy of each real expert row; row_weights [M_real] its routing weight; tokens_per_expert /
    real_tokens_per_expert int64 [E_local] rows per local expert with and without padding;
    source_weights: see `Route`."""

    row_k: torch.Tensor
    row_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    real_tokens_per_expert: torch.Tensor
    source_weights: torch.Tensor | None = None


def _reverse_through(earlier: list, back, dtype: torch.dtype, landed) -> torch.Tensor:
    """Combine's steps back through the communicating hops ``earlier`` (a route's hops before
    its last, last first), ``back`` the first reverse exchange in flight: each hop waits for its
    rows, sums their copies (with the weights ``landed(hop)`` gives, or None) and starts the
    reverse exchange of the hop before it. Returns the sums at the source [N, C]."""
    for hop, before in zip(earlier, earlier[1:] + [None]):
        back = hop.reverse(back, before, dtype, lambda hop=hop: landed(hop))
    return back


@dataclass
class Route:
    """The hops of one dispatch plus what the last level's rows carry.

    topk: K
    stages: the backend's plan of the route, a generator of `Stage`s (see below); None once it has run
    hops: communicating hops then the last (local, expanding) hop, appended as planned
    row_k, row_weights, tokens_per_expert, real_tokens_per_expert: see `ExpertRows`
    source_weights: for routes whose first hop sends one row per (token, expert) pair, the
        weight of each sent row: combine then weights the exact expert outputs where they are
        summed, on the source rank, instead of rounding weighted rows before they travel

    A backend plans a route top to bottom in one generator: it yields a `Stage` for each hop,
    and for a stage that sends metadata beside its rows it is resumed with the metadata this
    rank received, once it lands, to plan the next hop from it (who sent which rows, for which
    experts); it returns the `ExpertRows`. The first `forward` (dispatch) drives it: it posts
    each stage's metadata just before the stage's rows and resumes the plan while the rows are
    still travelling, so no exchange waits for a separate metadata round. Afterwards the route
    is complete and reused as is (combine, autograd).
    """

    topk: int
    stages: Generator | None = None
    hops: list = field(default_factory=list)
    row_k: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None
    real_tokens_per_expert: torch.Tensor | None = None
    source_weights: torch.Tensor | None = None
    groups: object = "the EP group"       # the EPGroups it runs on (or a label): see `running`
    workspace: Workspace | None = None    # the dispatcher's buffers (see `running`)

    @contextlib.contextmanager
    def running(self, what: str):
        """The context every step of this route runs in: errors and timeouts named after
        ``what`` on this route's group (`topology.guarded`), row buffers from the dispatcher's
        `Workspace`."""
        with guarded(what, self.groups), \
                (self.workspace.active() if self.workspace is not None else contextlib.nullcontext()):
            yield

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None):
        """[N, C] -> expert rows [M, C] (dispatch). With ``async_op`` the first exchange is
        left in flight and a `Transfer` is returned; its wait() plans and runs the remaining
        hops. ``sent``: the first hop's sent rows, already gathered (see `AllToAllHop.forward`)."""
        if self.stages is None:
            first = self._step(self.hops[0], rows, sent)
            pending = later(lambda: self._run(first, self.hops[1:]), lands=[first])
        else:
            stage = next(self.stages)
            level, meta = self._start(stage, rows, sent)
            pending = later(lambda: self._plan_and_run(level, meta), lands=[level, meta])
        return pending if async_op else pending.wait()

    def _start(self, stage: Stage, level, sent=None):
        """Append ``stage``'s hop, post its metadata, then its rows -> (its rows in flight, or
        its output; the metadata in flight, or None)."""
        self.hops.append(stage.hop)
        meta = None if stage.meta is None else stage.hop.send_meta(stage.meta)
        return self._step(stage.hop, level, sent), meta

    @staticmethod
    def _step(hop, level, sent=None):
        """Run ``hop`` on ``level`` (rows, or the `Transfer` bringing them: a `SplitHop` starts
        before it lands) -> its output, or for a communicating hop the Transfer of its rows."""
        if isinstance(hop, ExpandHop) and hop.streams and getattr(level, "parts", None):
            return hop.forward_parts(level)
        if not isinstance(hop, SplitHop) and isinstance(level, Transfer):
            level = level.wait()
        return hop.forward(level, async_op=True, sent=sent) if hop.communicates else hop.forward(level)

    def _plan_and_run(self, level, meta) -> torch.Tensor:
        """The first forward after its first stage: resume the plan with each stage's received
        metadata (while the stage's rows travel), start the next stage, until the plan ends."""
        while True:
            try:
                received = None if meta is None else meta.wait()
                _note(f"hop {len(self.hops)}: " + ("rows in place" if meta is None else "metadata landed"))
                stage = self.stages.send(received)
                _note(f"hop {len(self.hops) + 1} planned")
            except StopIteration as end:
                rows: ExpertRows = end.value
                self.row_k, self.row_weights = rows.row_k, rows.row_weights
                self.tokens_per_expert = rows.tokens_per_expert
                self.real_tokens_per_expert = rows.real_tokens_per_expert
                self.source_weights = rows.source_weights
                self.stages = None
                return level.wait() if isinstance(level, Transfer) else level
            level, meta = self._start(stage, level)

    def _run(self, level, hops: list) -> torch.Tensor:
        """Run ``hops`` on ``level``: the rows before them, or the `Transfer` bringing them (a
        `SplitHop` starts before it lands)."""
        for hop in hops:
            level = self._step(hop, level)
        return level.wait() if isinstance(level, Transfer) else level

    def exchanges(self) -> list[Exchange]:
        """The route's exchanges with other ranks, in dispatch order (a group of one, which
        exchanges nothing, is left out)."""
        return [Exchange(hop.kind, hop.channel, list(hop.peers),
                         list(hop.send_splits), list(hop.recv_splits), hop.meta_bytes, isinstance(hop, LandingHop))
                for hop in self.hops if hop.communicates and hop.channel.size > 1]

    @property
    def lands_in_place(self) -> bool:
        """Whether received rows land straight in their final places (see `LandingRuns`)."""
        return any(isinstance(hop, LandingHop) for hop in self.hops)

    def expert_weights(self) -> torch.Tensor:
        """[M] the routing weight of each expert row, 0 on padding (``DispatchResult.weights``).
        Only once the route is complete (after the first forward)."""
        return self.hops[-1].place(self.row_weights)

    def transpose(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert rows [M, C] -> [N, C]: sum of each token's rows (combine), each row scaled
        by ``weights [M]`` in fp32 first."""
        return self.transpose_async(rows, weights, out_dtype).wait()

    def transpose_async(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, at_source: bool = False,
                        agree=None) -> Transfer:
        """`transpose` with the first reverse exchange left in flight.

        at_source: apply the weights on the source side, to the exact rows once they are back
        (``source_weights``, the same values as ``weights``; routes whose first hop sends one
        row per (token, expert) pair), instead of to each row before it travels. agree:
        combine's cross-rank check, called on every rank once the first reverse exchange has
        landed and before anything else is sent; it raises to stop every rank there.
        """
        dtype = rows.dtype
        last, *earlier = reversed(self.hops)
        if at_source and (self.source_weights is None or not earlier):
            raise ValueError("at_source needs a route whose first hop carries source_weights")
        weights = None if at_source else weights
        agreed = []

        def landed(hop):                      # the first reverse exchange has landed
            if not agreed:
                agreed.append(agree() if agree is not None else None)
            return self.source_weights if at_source and hop is self.hops[0] else None

        def finish(back):
            return _reverse_through(earlier, back, dtype, landed).to(out_dtype or dtype)

        if earlier and isinstance(earlier[0], SplitHop) and earlier[0].streamed and last.streams:
            # Each part of the level before goes back as soon as its copies are summed.
            table = summing_table(rows, dtype)
            back = earlier[0].send_back(lambda a, b: last.transpose_part(table, weights, dtype, a, b))
            return later(lambda: finish(back))        # its parts are sent as they are summed, in finish
        rows = last.transpose(rows, weights, dtype)
        if not earlier:
            if agree is not None:
                agree()
            return Transfer(rows.to(out_dtype or dtype))
        back = earlier[0].send_back(rows)
        return later(lambda: finish(back), lands=[back])

    def weights_transpose_async(self, grad_weights: torch.Tensor) -> Transfer:
        """Gradient of the expert-row weights [M] -> gradient of ``topk_weights [N, K]``, with the
        first reverse exchange left in flight (posted beside the rows' gradients, so that it
        lands with them instead of waiting behind another micro-batch's rows afterwards).

        Each row of the last level gets a K-wide vector with the gradient in its top-k column;
        summing them back along the route is exact since each (token, k) occurs once.
        """
        last, *earlier = reversed(self.hops)
        real = grad_weights if last.out_pos is None else grad_weights.index_select(0, last.out_pos)
        per_row = torch.zeros(last.index.numel(), self.topk, dtype=grad_weights.dtype, device=grad_weights.device)
        per_row[torch.arange(per_row.shape[0], device=per_row.device), self.row_k] = real
        level = last.reduce(per_row, None, per_row.dtype)
        if not earlier:
            return Transfer(level)
        back = earlier[0].send_back(level)
        return later(lambda: _reverse_through(earlier, back, level.dtype, lambda hop: None), lands=[back])

    def stats(self, payload_bytes: int, my_rank: int, domain_size: int, backward: bool = False) -> TransferStats:
        """Transfer stats of dispatch (or of combine, ``backward``) for rows of ``payload_bytes``."""
        stats = TransferStats()
        for hop in self.hops:
            hop.add_stats(stats, payload_bytes, my_rank, domain_size, backward)
        return stats
