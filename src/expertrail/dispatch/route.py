"""Routes: the linear maps that carry rows from tokens to expert rows and back.

Every backend moves data the same way, only the steps differ. A `Route` is a list of `Hop`s:
each hop gathers rows of the previous level (a row may be taken several times: one copy per
destination) and, for a communicating hop, exchanges them with one all-to-all (or all-gather).
The last hop is local: it expands the received rows into expert-major rows, with padding.

Dispatch applies the hops forward. Combine applies their transpose: each hop's all-to-all
runs backwards and the copies of a row are summed back into it, in fp32 and in a fixed slot
order, so results are reproducible bit for bit. The autograd of dispatch is combine's
transpose and vice versa, so gradients need no extra code per backend.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels import reference
from ..kernels.reference import CopyPositions, take_rows
from ..topology import all_gather_single

LINK_CLASSES = ("self", "intra", "inter")



@dataclass
class TransferStats:
    """What this rank handed to collectives in one operation, per link class.

    ``bytes`` and ``rows`` count the payload rows with their metadata, as sent; link classes are
    ``self`` (to this rank), ``intra`` (another rank of its domain) and ``inter`` (another
    domain). ``control_bytes`` counts the small count/flag exchanges that size the transfers.
    """

    bytes: dict = field(default_factory=lambda: dict.fromkeys(LINK_CLASSES, 0))
    rows: dict = field(default_factory=lambda: dict.fromkeys(LINK_CLASSES, 0))
    control_bytes: int = 0

    def add(self, link: str, rows: int, row_bytes: int) -> None:
        self.rows[link] += rows
        self.bytes[link] += rows * row_bytes

    @property
    def remote_bytes(self) -> int:
        return self.bytes["intra"] + self.bytes["inter"]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class Hop:
    """Gather rows of the previous level, then exchange them over ``group``.

    index:  int64 [R] row of the previous level that each sent row copies, grouped by peer
    slot:   int64 [R] which copy of its source row this is, in [0, num_slots): the order in
            which copies are summed back
    num_src: rows of the previous level; num_slots: most copies of one source row
    send_splits / recv_splits: rows per peer of ``group`` (None: a local hop, no exchange)
    peers: EP rank of each member of ``group`` (for link classes)
    gathered: the exchange is an all-gather (every peer gets the same ``num_src`` rows)
    out_pos / out_rows: for the last hop, where each row lands in the padded output
    meta_bytes: metadata bytes sent with each row on the way out (ids, weights, sources)
    runs: for a hop whose received rows land directly in their final places (no local
        permutation after it), `LandingRuns`; its last hop is then an ``identity`` hop
    identity: a local hop that leaves the rows where they are (``out_pos``, when set, marks
        the real ones among padding)
    positions: the `CopyPositions` of ``index`` / ``slot`` when the planner has them at hand
        (built from ``index`` and ``slot`` on first use otherwise)
    me: for an all-to-all hop, this rank's index in ``group``: the rows it sends itself are
        gathered straight into place instead of through the send buffer
    meta / then: on the first forward only, for a route planned in stages: ``meta`` is the
        metadata of the rows this hop receives, in flight beside them (a `Transfer`), and
        ``then(meta)`` plans the hops after this one (see `Route.forward`)
    """

    index: torch.Tensor
    slot: torch.Tensor
    num_src: int
    num_slots: int
    group: object = None
    send_splits: list | None = None
    recv_splits: list | None = None
    peers: list | None = None
    gathered: bool = False
    out_pos: torch.Tensor | None = None
    out_rows: int | None = None
    meta_bytes: int = 0
    runs: "LandingRuns | None" = None
    identity: bool = False
    me: int | None = None
    meta: "Transfer | None" = None
    then: object = None
    positions: CopyPositions | None = None

    @property
    def local(self) -> bool:
        return self.group is None

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None,
                out: torch.Tensor | None = None):
        """[num_src, C] -> rows received (or, for the last hop, the padded output).
        With ``async_op`` a communicating hop returns a `Transfer` to wait on. ``sent``: the
        rows this hop sends, ``rows[index]``, when the caller gathered them already. ``out``:
        where an all-to-all hop receives its rows (default: a new tensor)."""
        if self.runs is not None:
            if sent is None and kernels.use_triton(rows):
                transfer = self.runs.exchange(kernels.permute_rows(rows, self.destinations(), self.index.numel()),
                                              forward=True)
            else:
                if sent is None:
                    sent = gather_rows(rows, self.index, self.runs.local_block())
                transfer = self.runs.exchange(sent, forward=True, source=rows, index=self.index)
            return transfer if async_op else transfer.wait()
        if self.identity:
            return rows
        if self.local:
            if kernels.use_triton(rows):
                return kernels.permute_rows(rows, self.destinations(), self.out_rows or self.index.numel(),
                                            self.padding_rows())
            return self.place(take_rows(rows, self.index))
        if self.gathered:
            return self.exchange(rows, async_op)
        if sent is None and kernels.use_triton(rows):
            return self.exchange(kernels.permute_rows(rows, self.destinations(), self.index.numel()), async_op, out)
        own = None if self.me is None else (rows, self.index)
        if sent is None:
            sent = gather_rows(rows, self.index, self.own_block())
        transfer = all_to_all_rows(sent, self.send_splits, self.recv_splits, self.group, own, out)
        return transfer if async_op else transfer.wait()

    def own_block(self) -> tuple | None:
        """(start, end) of the sent rows that stay on this rank, when they are gathered straight
        into place (see ``me``), else None."""
        return None if self.me is None else own_block(self.send_splits, self.me)

    def own_block_received(self) -> tuple:
        """(start, end) of the received rows that this rank sent itself (all-to-all hops)."""
        return own_block(self.recv_splits, self.me)

    def destinations(self) -> torch.Tensor:
        """int64 [num_src, num_slots]: output row of each copy of each source row (-1: none)."""
        if getattr(self, "_destinations", None) is None:
            dense = self.copies().dense()
            if self.out_pos is not None:
                dense = torch.where(dense >= 0, self.out_pos[dense.clamp(min=0)], dense)
            self._destinations = dense
        return self._destinations

    def padding_rows(self):
        """Output rows of the last hop that no copy fills (alignment / capacity padding)."""
        if self.out_pos is None:
            return None
        if getattr(self, "_padding", None) is None:
            filled = torch.zeros(self.out_rows, dtype=torch.bool, device=self.out_pos.device)
            filled[self.out_pos] = True
            self._padding = torch.nonzero(~filled).squeeze(1)
        return self._padding

    def exchange(self, sent: torch.Tensor, async_op: bool = False, out: torch.Tensor | None = None):
        """Exchange rows already laid out as sent ([R, C], or [num_src, C] for an all-gather);
        ``out``: see `forward` (all-to-all hops)."""
        if self.runs is not None:
            transfer = self.runs.exchange(sent, forward=True)
        elif self.gathered:
            transfer = all_gather_rows(sent, self.recv_splits, self.group)
        else:
            transfer = all_to_all_rows(sent, self.send_splits, self.recv_splits, self.group, out=out)
        return transfer if async_op else transfer.wait()

    def place(self, rows: torch.Tensor) -> torch.Tensor:
        """Real output rows [M_real, ...] -> padded output [M, ...] (zeros on padding)."""
        if self.out_pos is None:
            return rows
        out = rows.new_zeros(self.out_rows, *rows.shape[1:])
        return out.index_copy_(0, self.out_pos, rows)

    def transpose(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Received rows [sum(recv), C] -> [num_src, C]: copies summed (fp32) per source row.

        ``weights [rows]`` scale each copy before the sum (the last hop of a weighted combine).
        """
        if self.identity and weights is None:
            return rows.to(out_dtype or rows.dtype)
        if self.local:
            if self.out_pos is not None:
                rows = rows.index_select(0, self.out_pos)
                weights = None if weights is None else weights.index_select(0, self.out_pos)
        else:
            rows = self.send_back(rows).wait()
        return self.reduce(rows, weights, out_dtype or rows.dtype)

    def send_back(self, rows: torch.Tensor, own_later: bool = False) -> "Transfer":
        """Start the reverse exchange of a communicating hop (the first half of `transpose`).
        own_later: this rank's own block of ``rows`` is not computed yet; the caller writes it
        into the Transfer's ``own_rows`` before waiting (gloo only, see `all_to_all_rows`)."""
        if self.runs is not None:
            return self.runs.exchange(rows, forward=False)
        return all_to_all_rows(rows, self.recv_splits, self.send_splits, self.group, own_later=own_later)

    def reverse(self, back: "Transfer", before: "Hop | None", dtype: torch.dtype, landed):
        """Combine's step through this hop: wait for the rows coming back (``back``, from
        `send_back`), call ``landed()`` (it returns the weights for the reduce, or None), sum the
        copies of each source row and start the reverse exchange of the hop ``before`` this one.
        Returns that Transfer, or the sums [num_src, C] when ``before`` is None."""
        rows = back.wait()
        summed = self.reduce(rows, landed(), dtype)
        return summed if before is None else before.send_back(summed)

    def reduce(self, rows: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """Sum the copies of each source row (the second half of `transpose`)."""
        return reduce_copies(rows, self.copies(), weights, out_dtype)

    def copies(self) -> "CopyPositions":
        """Where each source row's copies sit among the rows of this hop (cached)."""
        if self.positions is None:
            self.positions = CopyPositions.build(self.index, self.slot, self.num_src, self.num_slots)
        return self.positions

    def add_stats(self, stats: TransferStats, payload_bytes: int, my_rank: int, domain_size: int,
                  backward: bool = False) -> None:
        """Count the rows this hop sends (forward, with metadata) or sends back (transpose)."""
        if self.local:
            return
        row_bytes = payload_bytes if backward else payload_bytes + self.meta_bytes
        splits = self.recv_splits if backward else self.send_splits
        if self.gathered and not backward:
            splits = [max(self.recv_splits)] * len(self.peers)   # all-gather sends padded rows
        for peer, count in zip(self.peers, splits):
            stats.add(link_class(my_rank, peer, domain_size), count, row_bytes)


class SplitHop:
    """A communicating hop sent as two exchanges, so that it starts before the hop before it
    has landed: the two-level route's pipelining, as in DeepEP's and Hybrid-EP's internode
    kernels, whose NVLink stage forwards rows while others are still crossing the NIC.

    early: forwards the rows of the previous level that this rank sent itself (its own block,
        rows ``own = (start, end)``), in place as soon as the previous exchange is posted; its
        ``index`` counts from ``start``
    late: forwards the others once they land; its ``index`` is over the whole previous level
        (none of its copies is in the own block)

    Rows are received early's first, then late's. Combine runs the mirror image: late's rows
    go back first, and the previous hop's reverse exchange starts as soon as they are summed,
    while early's are still coming back (on gloo, whose point-to-point transfers let this
    rank's own block be filled after the others are posted).
    """

    local = False
    gathered = False
    runs = None

    def __init__(self, early: Hop, late: Hop, own: tuple):
        self.early, self.late, self.own = early, late, own
        self.meta: Transfer | None = None
        self.then = None

    # One exchange's view, for stats and for the bench's bare collectives.
    group = property(lambda self: self.late.group)
    peers = property(lambda self: self.late.peers)
    meta_bytes = property(lambda self: self.late.meta_bytes)
    num_src = property(lambda self: self.late.num_src)
    send_splits = property(lambda self: [a + b for a, b in zip(self.early.send_splits, self.late.send_splits)])
    recv_splits = property(lambda self: [a + b for a, b in zip(self.early.recv_splits, self.late.recv_splits)])

    def forward(self, level, async_op: bool = False):
        """The previous level's rows [num_src, C], or the `Transfer` bringing them -> the rows
        received [sum(recv_splits), C]: early's exchange is posted before ``level`` is waited for."""
        start, end = self.own
        in_flight = isinstance(level, Transfer)
        own_rows = level.own_rows if in_flight and level.own_rows is not None else None
        if own_rows is None:
            own_rows = (level.wait() if in_flight else level)[start:end]
        split = sum(self.early.recv_splits)
        out = own_rows.new_empty(split + sum(self.late.recv_splits), *own_rows.shape[1:])
        early = self.early.forward(own_rows, async_op=True, out=out[:split])
        late = self.late.forward(level.wait() if in_flight else level, async_op=True, out=out[split:])
        transfer = Transfer(out, _AllWorks([early, late]))
        return transfer if async_op else transfer.wait()

    def send_back(self, rows: torch.Tensor) -> "_SplitBack":
        """Start the reverse exchanges, late's rows first."""
        split = sum(self.early.recv_splits)
        late = self.late.send_back(rows[split:])
        return _SplitBack(early=self.early.send_back(rows[:split]), late=late)

    def reverse(self, back: "_SplitBack", before: Hop | None, dtype: torch.dtype, landed):
        """See `Hop.reverse`; ``before``'s reverse exchange starts once late's rows are summed."""
        late = back.late.wait()
        try:
            weights = landed()
        except BaseException:
            back.early.wait()             # raise with nothing of this hop left in flight
            raise
        if weights is not None:
            raise ValueError("a split hop is never a route's first hop, whose reduce alone takes weights")
        summed = self.late.reduce(late, None, dtype)          # zeros on the own block
        start, end = self.own
        if before is not None and not before.local and before.runs is None and on_gloo(before.group):
            pending = before.send_back(summed, own_later=True)
            pending.own_rows.copy_(self.early.reduce(back.early.wait(), None, dtype))
            return pending
        summed[start:end] = self.early.reduce(back.early.wait(), None, dtype)
        return summed if before is None else before.send_back(summed)

    def transpose(self, rows: torch.Tensor) -> torch.Tensor:
        """Received rows -> [num_src, C], copies summed per source row (unweighted)."""
        return self.reverse(self.send_back(rows), None, rows.dtype, lambda: None)

    def add_stats(self, stats: TransferStats, payload_bytes: int, my_rank: int, domain_size: int,
                  backward: bool = False) -> None:
        for part in (self.early, self.late):
            part.add_stats(stats, payload_bytes, my_rank, domain_size, backward)


@dataclass
class _SplitBack:
    """A `SplitHop`'s two reverse exchanges in flight."""

    early: "Transfer"
    late: "Transfer"


def concat_transfers(transfers: list) -> Transfer:
    """One Transfer yielding the rows of ``transfers``, concatenated in order."""
    return Transfer(transfers, None, lambda ts: torch.cat([t.wait() for t in ts]))


def own_block(send_splits: list, me: int) -> tuple:
    """(start, end) of the block sent to peer ``me`` among rows laid out peer by peer."""
    start = sum(send_splits[:me])
    return start, start + send_splits[me]


def link_class(me: int, peer: int, domain_size: int) -> str:
    if peer == me:
        return "self"
    return "intra" if peer // domain_size == me // domain_size else "inter"


def reduce_copies(rows: torch.Tensor, copies: CopyPositions, weights: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over slots s, ascending, of weights * rows[copy s of i] in fp32: the Triton
    kernel for CUDA tensors, else `kernels.reference.reduce_copies`."""
    if kernels.use_triton(rows):
        return kernels.reduce_copies_dense(rows, copies.dense(), weights, out_dtype)
    return reference.reduce_copies(rows, copies, weights, out_dtype)


def reduce_rows(rows: torch.Tensor, index: torch.Tensor, slot: torch.Tensor, num_out: int,
                num_slots: int, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over s (ascending) of weights * rows[j] where index[j] == i and slot[j] == s.

    rows [R, C], index/slot int64 [R], weights [R] or None -> [num_out, C] in ``out_dtype``.
    """
    return reduce_copies(rows, CopyPositions.build(index, slot, num_out, num_slots), weights, out_dtype)


class Transfer:
    """An exchange in flight: ``wait()`` returns the received rows.

    own_rows: where known, the rows this rank sends itself, already in place (valid before
    ``wait()``): a next hop can start forwarding them while the other rows travel (`SplitHop`).
    """

    def __init__(self, out: torch.Tensor, work=None, finish=None, own_rows: torch.Tensor | None = None):
        self._out, self._work, self._finish = out, work, finish
        self.own_rows = own_rows

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._out, self._finish = self._finish(self._out), None
        return self._out


@dataclass
class LandingRuns:
    """An all-to-all whose received rows land straight in their final places.

    The sent rows and the landing buffer are each cut into consecutive pieces: ``send_sizes``
    / ``recv_sizes`` rows each (gaps, e.g. padding, are pieces too). ``send[p]`` / ``recv[p]``
    number the pieces exchanged with peer p of the group, matched in order (piece j sent to p
    is piece j received from us). ``out_rows``: rows of the landing buffer; ``zero_fill``: it
    has padding rows that must read as zeros. The exchange is a batch of point-to-point
    transfers, one per non-empty piece (the pieces to this rank are copies).
    """

    send_sizes: list
    recv_sizes: list
    send: list
    recv: list
    peer_ranks: list
    me: int
    group: object
    out_rows: int
    zero_fill: bool

    def local_block(self) -> tuple:
        """(start, end) of the sent rows that stay on this rank (consecutive pieces)."""
        mine = self.send[self.me]
        if not mine:
            return 0, 0
        start = sum(self.send_sizes[:mine[0]])
        return start, start + sum(self.send_sizes[mine[0]:mine[-1] + 1])

    def exchange(self, rows: torch.Tensor, forward: bool, source: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> "Transfer":
        """Forward: rows [sum(send_sizes), C] -> landing [out_rows, C]; backward the reverse.
        With ``source`` and ``index`` (forward), the rows that stay on this rank are gathered
        from ``source[index]`` straight into place (their pieces of ``rows`` are not read)."""
        send, recv, send_sizes, recv_sizes = (self.send, self.recv, self.send_sizes, self.recv_sizes) if forward \
            else (self.recv, self.send, self.recv_sizes, self.send_sizes)
        out = rows.new_zeros(sum(recv_sizes), *rows.shape[1:]) if forward and self.zero_fill else \
            rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        sent, landing = rows.split_with_sizes(send_sizes), out.split_with_sizes(recv_sizes)  # views, one call each
        sends, recvs = [], []
        first_tag = reserve_tags(self.group, max(len(pieces) for pieces in send))
        for p in range(len(self.peer_ranks)):
            if p == self.me:
                rows_of = index.split_with_sizes(send_sizes) if source is not None else None
                for a, b in zip(send[p], recv[p]):
                    if source is not None:
                        take_rows(source, rows_of[a], out=landing[b])
                    else:
                        landing[b].copy_(sent[a])
                continue
            sends += [(sent[a], p, first_tag + j) for j, a in enumerate(send[p]) if send_sizes[a]]
            recvs += [(landing[b], p, first_tag + j) for j, b in enumerate(recv[p]) if recv_sizes[b]]
        return Transfer(out, _AllWorks(post_point_to_point(sends, recvs, self.group, self.peer_ranks)))


def post_point_to_point(sends: list, recvs: list, group, peer_ranks: list) -> list:
    """Start point-to-point transfers: ``sends`` / ``recvs`` hold (tensor, group rank, tag).

    On gloo the process group is called directly, receives first, then sends starting with the
    next rank (so that peers do not all send to the same rank first): the Python wrappers of
    ``batch_isend_irecv`` cost ~50 us per transfer, as much as a small transfer itself. Other
    backends (NCCL) need the batch, which groups the transfers so their order cannot deadlock.
    Transfers in flight together need distinct tags (`reserve_tags`).
    """
    if not sends and not recvs:
        return []
    pg = group if group is not None else dist.group.WORLD
    if on_gloo(pg):
        me, size = pg.rank(), pg.size()
        sends = sorted(sends, key=lambda s: (s[1] - me) % size)
        return [pg.recv([t], peer, tag) for t, peer, tag in recvs] + [pg.send([t], peer, tag) for t, peer, tag in sends]
    ops = [dist.P2POp(dist.irecv, t, peer_ranks[p], group, tag) for t, p, tag in recvs]
    ops += [dist.P2POp(dist.isend, t, peer_ranks[p], group, tag) for t, p, tag in sends]
    return dist.batch_isend_irecv(ops)


class _AllWorks:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def gather_rows(rows: torch.Tensor, index: torch.Tensor, skip: tuple | None = None) -> torch.Tensor:
    """rows[index] -> [len(index), C]; the output rows in the range ``skip = (start, end)`` are
    left unfilled (rows that stay on this rank and are put in place by the hop itself)."""
    if skip is None or skip[0] == skip[1]:
        return take_rows(rows, index)
    out = rows.new_empty(index.numel(), *rows.shape[1:])
    start, end = skip
    take_rows(rows, index[:start], out=out[:start])
    take_rows(rows, index[end:], out=out[end:])
    return out


_TAGS = 1 << 30
_next_tag: dict = {}


def reserve_tags(group, count: int) -> int:
    """The first of ``count`` point-to-point tags for one exchange on ``group``.

    Every member of a group starts the same exchanges on it in the same order, so counting them
    gives every rank the same tags, and exchanges in flight together (rows and their metadata,
    the chunks of an overlapped MoE) distinct ones: gloo serialises transfers that share a
    (peer, tag) pair.
    """
    key = group if group is not None else dist.group.WORLD
    first = _next_tag.get(key, 0)
    _next_tag[key] = (first + count) % _TAGS
    return first if first + count <= _TAGS else reserve_tags(group, count)


def all_to_all_rows(rows: torch.Tensor, send_splits: list, recv_splits: list, group,
                    own: tuple | None = None, out: torch.Tensor | None = None,
                    own_later: bool = False) -> Transfer:
    """Start sending ``rows [sum(send_splits), C]`` in per-peer blocks; the Transfer yields
    [sum(recv_splits), C] (received into ``out`` when given). ``own = (source, index)``: the
    block this rank sends itself is ``source[index[block]]``, gathered straight into the output
    (that block of ``rows`` is not read). The Transfer's ``own_rows`` is that block.
    ``own_later`` (gloo only): that block is neither read nor copied; the caller fills
    ``own_rows`` in the output before waiting.

    On gloo the blocks go as point-to-point transfers, all posted at once: gloo's all-to-all
    runs its peers in lockstep steps, so with more ranks than cores one descheduled peer stalls
    every step (measured: the same bytes took 1.3x longer inside a dispatch). Each exchange
    has a tag of its own (`reserve_tags`).
    """
    if len(send_splits) == 1:       # a group of one: nothing to exchange
        mine = take_rows(*own, out=out) if own is not None else rows if out is None else out.copy_(rows)
        return Transfer(mine, own_rows=mine)
    if out is None:
        out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    pg = group if group is not None else dist.group.WORLD
    me, gloo = pg.rank(), on_gloo(pg)
    if own_later and not gloo:
        raise ValueError("own_later needs point-to-point transfers (gloo): a collective reads every block at once")
    rows = rows.contiguous()
    sent = rows.split_with_sizes(send_splits)
    received = out.split_with_sizes(recv_splits)
    mine = received[me] if gloo else sent[me]
    if own is not None:
        source, index = own
        take_rows(source, index.split_with_sizes(send_splits)[me], out=mine)
    elif gloo and not own_later:
        mine.copy_(sent[me])
    if not gloo:
        return Transfer(out, dist.all_to_all_single(out, rows, recv_splits, send_splits, group=group, async_op=True),
                        own_rows=mine)
    tag = reserve_tags(pg, 1)
    recvs = [(received[p], p, tag) for p, c in enumerate(recv_splits) if c and p != me]
    sends = [(sent[p], p, tag) for p, c in enumerate(send_splits) if c and p != me]
    return Transfer(out, _AllWorks(post_point_to_point(sends, recvs, group, None)), own_rows=mine)


_GLOO: dict = {}


def on_gloo(pg) -> bool:
    """Whether process group ``pg`` runs on gloo (asked once per group: `dist.get_backend`
    costs ~30 us, and a dispatch asks for every exchange)."""
    if pg not in _GLOO:
        _GLOO[pg] = dist.get_backend(pg) == "gloo"
    return _GLOO[pg]


def all_gather_rows(rows: torch.Tensor, counts: list, group) -> Transfer:
    """Start gathering every peer's rows; the Transfer yields them concatenated in peer order,
    [sum(counts), C]. Ranks send ``max(counts)`` rows each (padding)."""
    if len(counts) == 1:
        return Transfer(rows)
    most = max(counts)
    padded = rows.new_zeros(most, *rows.shape[1:])
    padded[:rows.shape[0]] = rows
    out = rows.new_empty(len(counts) * most, *rows.shape[1:])
    work = all_gather_single(out, padded, group=group, async_op=True)
    if all(c == most for c in counts):
        return Transfer(out, work)
    keep = torch.cat([torch.arange(p * most, p * most + c, device=rows.device) for p, c in enumerate(counts)])
    return Transfer(out, work, lambda full: full.index_select(0, keep))


@dataclass
class Route:
    """The hops of one dispatch plus what the last level's rows carry.

    hops: communicating hops then the last (local, expanding) hop
    topk: K
    row_k: int64 [M_real] top-k slot of each real expert row
    row_weights: [M_real] routing weight of each real expert row
    tokens_per_expert / real_tokens_per_expert: int64 [E_local] rows with and without padding
    source_weights: for routes whose first hop sends one row per (token, expert) pair, the
        weight of each sent row: combine then weights the exact expert outputs where they are
        summed, on the source rank, instead of rounding weighted rows before they travel

    A route may be planned in stages: a backend plans the hops it can from the counts, and a
    hop whose receivers need metadata to plan the rest sends it beside its rows (``Hop.meta``)
    with a ``Hop.then`` that appends the next hops (the last one sets the row fields above).
    The first `forward` (dispatch) runs them as the metadata arrives, so no exchange waits for
    a separate metadata round; afterwards the route is complete and reused as is.
    """

    hops: list
    topk: int
    row_k: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None
    real_tokens_per_expert: torch.Tensor | None = None
    source_weights: torch.Tensor | None = None
    dispatched_weights: object = None     # weakref to res.weights and its version, see combine
    label: str = "the EP group"           # for error messages
    timeout: float | None = None

    def forward(self, rows: torch.Tensor, async_op: bool = False, sent: torch.Tensor | None = None):
        """[N, C] -> expert rows [M, C] (dispatch). With ``async_op`` the first exchange is
        left in flight and a `Transfer` is returned; its wait() plans and runs the remaining
        hops. ``sent``: the first hop's sent rows, already gathered (see `Hop.forward`)."""
        first = self.hops[0]
        if first.local:
            out = self._run(first.forward(rows, sent=sent), 1)
            return Transfer(out) if async_op else out
        transfer = first.forward(rows, async_op=True, sent=sent)

        def finish(t):
            self._plan_after(first)          # the metadata travels ahead of the rows
            return self._run(t, 1)
        pending = Transfer(transfer, None, finish)
        return pending if async_op else pending.wait()

    def _run(self, level, start: int) -> torch.Tensor:
        """Run hops ``start...`` on ``level``: the rows before hop ``start``, or the `Transfer`
        bringing them (a `SplitHop` starts before it lands)."""
        i = start
        while i < len(self.hops):             # hops may be appended on the way
            hop = self.hops[i]
            if not isinstance(hop, SplitHop) and isinstance(level, Transfer):
                level = level.wait()
            if hop.local:
                level = hop.forward(level)
            else:
                level = hop.forward(level, async_op=True)
                self._plan_after(hop)
            i += 1
        return level.wait() if isinstance(level, Transfer) else level

    @staticmethod
    def _plan_after(hop: Hop) -> None:
        if hop.then is not None:
            then, meta = hop.then, hop.meta
            hop.then = hop.meta = None
            then(meta.wait())

    def remember_weights(self, weights: torch.Tensor) -> None:
        """Record the row weights handed out by dispatch, so combine can tell them apart from
        weights the caller replaced or modified in place."""
        self.dispatched_weights = (weakref.ref(weights), weights._version)

    def weights_at_source(self, weights: torch.Tensor | None) -> bool:
        """Whether a combine with ``weights`` leaves them to the source side: only on routes
        with ``source_weights`` and only for the weights dispatch handed out, unchanged (the
        caller's own or modified weights are applied on the expert side, as given)."""
        if weights is None or self.source_weights is None or self.dispatched_weights is None:
            return False
        ref, version = self.dispatched_weights
        return ref() is weights and weights._version == version

    def transpose(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert rows [M, C] -> [N, C]: sum of each token's rows (combine), each row scaled
        by ``weights [M]`` in fp32 first."""
        return self.transpose_async(rows, weights, out_dtype).wait()

    def transpose_async(self, rows: torch.Tensor, weights: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, at_source: bool | None = None,
                        agree=None) -> Transfer:
        """`transpose` with the first reverse exchange left in flight.

        at_source: this rank leaves ``weights`` to the source side (default:
        `weights_at_source`). agree: combine's cross-rank check, called on every rank once the
        first reverse exchange has landed and before anything else is sent; it raises, or
        returns bool [P]: which EP peers left their weights to the source side, so that the
        rows each peer sends back are weighted exactly once.
        """
        dtype = rows.dtype
        at_source = self.weights_at_source(weights) if at_source is None else at_source
        last, *earlier = reversed(self.hops)
        rows = last.transpose(rows, None if at_source else weights, dtype)
        if not earlier:
            if agree is not None:
                agree()
            return Transfer(rows.to(out_dtype or dtype))
        agreed = []

        def landed(hop):                      # the first reverse exchange has landed
            if not agreed:
                agreed.append(agree() if agree is not None else at_source)
            return self._source_side_weights(agreed[0]) if hop is self.hops[0] else None

        def finish(back):
            for hop, before in zip(earlier, earlier[1:] + [None]):
                back = hop.reverse(back, before, dtype, lambda hop=hop: landed(hop))
            return back.to(out_dtype or dtype)
        return Transfer(earlier[0].send_back(rows), None, finish)

    def _source_side_weights(self, peers_at_source) -> torch.Tensor | None:
        """The weights the first hop's reduce applies: ``source_weights`` for the rows of peers
        that left the weighting to this side, 1 for the others (exact: x * 1.0 == x), None when
        no peer did. peers_at_source: bool, or bool [P] per peer of the first hop."""
        if self.source_weights is None:
            return None
        if isinstance(peers_at_source, bool):
            return self.source_weights if peers_at_source else None
        if bool(peers_at_source.all()):
            return self.source_weights
        if not bool(peers_at_source.any()):
            return None
        first = self.hops[0]
        splits = torch.tensor(first.send_splits, device=self.source_weights.device)
        weighted_here = peers_at_source.to(self.source_weights.device).repeat_interleave(splits)
        return torch.where(weighted_here, self.source_weights, torch.ones_like(self.source_weights))

    def weights_transpose(self, grad_weights: torch.Tensor) -> torch.Tensor:
        """Gradient of the expert-row weights [M] -> gradient of ``topk_weights [N, K]``.

        Each row of the last level gets a K-wide vector with the gradient in its top-k column;
        summing them back along the route is exact since each (token, k) occurs once.
        """
        last = self.hops[-1]
        real = grad_weights if last.out_pos is None else grad_weights.index_select(0, last.out_pos)
        per_row = torch.zeros(last.index.numel(), self.topk, dtype=grad_weights.dtype, device=grad_weights.device)
        per_row[torch.arange(per_row.shape[0], device=per_row.device), self.row_k] = real
        level = reduce_rows(per_row, last.index, last.slot, last.num_src, last.num_slots, None, per_row.dtype)
        for hop in reversed(self.hops[:-1]):
            level = hop.transpose(level)
        return level

    def stats(self, payload_bytes: int, my_rank: int, domain_size: int, backward: bool = False) -> TransferStats:
        """Transfer stats of dispatch (or of combine, ``backward``) for rows of ``payload_bytes``."""
        stats = TransferStats()
        for hop in self.hops:
            hop.add_stats(stats, payload_bytes, my_rank, domain_size, backward)
        return stats
