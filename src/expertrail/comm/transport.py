"""How rows move between ranks: channels, exchanges in flight, and point-to-point transfers.

A `Channel` is one process group as the engine's exchanges use it: all-to-all and all-gather
of rows, point-to-point transfers, and the tags that keep exchanges in flight together apart.
`EPGroups.channel` hands out one channel per process group, so that every exchange on a group
draws its tags from the same counter. An exchange returns a `Transfer`, whose ``wait()`` gives
the received rows. `LandingRuns` is an all-to-all whose rows land straight in their final
places, piece by piece. `TransferStats` counts what one operation sent, per link class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.distributed as dist

from ..kernels.torch_ops import take_rows
from ..kernels.workspace import allocate, allocate_zeros

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_TAGS = 1 << 30

# The fewest rows a piece is cut to: smaller pieces cost more in messages and planning than
# they gain in overlap (the tiny model of `expertrail train` on loopback: docs/benchmarks.md).
MIN_PIECE_ROWS = 128

# The largest block (bytes per member) `Channel.all_to_all_fixed` sends through gloo's own
# all-to-all: below it the one call beats a transfer per peer (0.75-0.82x the time from 256 B
# to 256 KiB per peer on 4 ranks, even at 512 KiB: benchmarks/small_exchanges.py).
COLLECTIVE_MAX_BLOCK_BYTES = 256 * 1024


class Transfer:
    """Work in flight, the engine's one handle type: ``wait()`` waits for the posted ``works``
    (collectives, or other Transfers), then runs ``then`` once on the result (the rest of an
    operation: a dispatch's remaining hops, a combine's reverse, a concatenation) and returns
    it; later waits return the same.

    result: what the works fill in (the received rows), or None. own_rows: where known, the
    rows this rank sends itself, already in place (valid before ``wait()``): a next hop can
    start forwarding them while the other rows travel (`route.SplitHop`).
    """

    def __init__(self, result=None, works=(), then=None, own_rows: torch.Tensor | None = None, lands=()):
        self._result, self._works, self._then = result, list(works), then
        self.own_rows = own_rows
        self._lands = [t for t in lands if isinstance(t, Transfer)]

    def land(self) -> None:
        """Wait for the exchanges posted so far (nested Transfers' too, and those ``then`` will
        consume: ``lands``) without running ``then`` (which may post more): what a helper
        thread may do while the caller computes. A gloo point-to-point work must be waited for
        once only, so they are dropped here."""
        for work in self._works + self._lands:
            if isinstance(work, Transfer):
                work.land()
            else:
                work.wait()
        self._works = [work for work in self._works if isinstance(work, Transfer)]

    def wait(self):
        for work in self._works:
            work.wait()
        self._works = []
        if self._then is not None:
            self._result, self._then = self._then(self._result), None
        return self._result


def later(rest, lands=()) -> Transfer:
    """The rest of an operation, whose first exchange is posted, as a `Transfer`: ``rest()``
    runs on the first ``wait()``. lands: the Transfers in flight that ``rest`` consumes (the
    first exchange's rows, its metadata), which ``land()`` waits for: a helper thread that
    lands this Transfer returns once they have landed, not at once."""
    return Transfer(then=lambda _: rest(), lands=lands)


def concat_transfers(transfers: list) -> Transfer:
    """The rows of ``transfers``, concatenated in order, on ``wait()``."""
    return later(lambda: torch.cat([t.wait() for t in transfers]), lands=transfers)


class Channel:
    """One process group as the engine's exchanges use it.

    group: the torch.distributed group (None: the default group); size, rank: its size and this
    rank's index in it; global_ranks: the default group's rank of each member; gloo: whether it
    runs on gloo (asked once: ``dist.get_backend`` is a Python call per exchange otherwise;
    docs/decisions.md: The group's backend asked once).

    Point-to-point tags (`reserve_tags`): every member starts the same exchanges on a group in
    the same order, so counting them gives every rank the same tags, and exchanges in flight
    together (rows and their metadata, the chunks of an overlapped MoE) distinct ones: gloo
    serialises transfers that share a (peer, tag) pair (docs/decisions.md: A tag per exchange).
    So there must be one channel per process group (`EPGroups.channel`).
    """

    def __init__(self, group=None):
        self.group = group
        self._pg = group if group is not None else dist.group.WORLD
        self.size, self.rank = self._pg.size(), self._pg.rank()
        self.global_ranks = dist.get_process_group_ranks(self._pg)
        self.gloo = dist.get_backend(self._pg) == "gloo"
        self._next_tag = 0

    def reserve_tags(self, count: int) -> int:
        """The first of ``count`` consecutive tags for one exchange."""
        if self._next_tag + count > _TAGS:
            self._next_tag = 0
        first = self._next_tag
        self._next_tag += count
        return first

    def post(self, sends: list, recvs: list) -> list:
        """Start point-to-point transfers: ``sends`` / ``recvs`` hold (tensor, member, tag).

        On gloo the process group is called directly, receives first, then sends starting with
        the next member (so that peers do not all send to the same rank first): the Python
        wrappers of ``batch_isend_irecv`` cost about as much as a small transfer itself
        (docs/decisions.md: gloo's process group called directly). Other backends (NCCL) need
        the batch, which groups the transfers so their order cannot deadlock.
        """
        if not sends and not recvs:
            return []
        if self.gloo:
            sends = sorted(sends, key=lambda s: (s[1] - self.rank) % self.size)
            return [self._pg.recv([t], peer, tag) for t, peer, tag in recvs] + \
                [self._pg.send([t], peer, tag) for t, peer, tag in sends]
        ops = [dist.P2POp(dist.irecv, t, self.global_ranks[p], self.group, tag) for t, p, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self.global_ranks[p], self.group, tag) for t, p, tag in sends]
        return dist.batch_isend_irecv(ops)

    def all_to_all(self, rows: torch.Tensor, send_splits: list, recv_splits: list, own: tuple | None = None,
                   out: torch.Tensor | None = None, own_later: bool = False, pieces: int = 1,
                   piece_rows: int = MIN_PIECE_ROWS) -> Transfer:
        """Start sending ``rows [sum(send_splits), C]`` in per-member blocks; the Transfer
        yields [sum(recv_splits), C] (received into ``out`` when given). ``own = (source,
        index)``: the block this rank sends itself is ``source[index[block]]``, gathered
        straight into the output (that block of ``rows`` is not read). The Transfer's
        ``own_rows`` is that block. ``own_later`` (gloo only): that block is neither read nor
        copied; the caller fills ``own_rows`` in the output before waiting.

        On gloo the blocks go as point-to-point transfers, all posted at once: gloo's
        all-to-all runs its peers in lockstep steps, so with more ranks than cores one
        descheduled peer stalls every step (docs/decisions.md: All-to-all on gloo as
        point-to-point transfers). ``pieces`` > 1 (gloo): each block travels in up to that many
        consecutive pieces of at least ``piece_rows`` rows (`piece_bounds`), and the Transfer's
        ``pieces`` lists (start, end, Transfer) of each piece received (rows of the output), to
        be waited for as it lands.
        """
        if self.size == 1:       # a group of one: nothing to exchange
            mine = take_rows(*own, out=out) if own is not None else rows if out is None else out.copy_(rows)
            return Transfer(mine, own_rows=mine)
        if out is None:
            out = allocate((sum(recv_splits), *rows.shape[1:]), rows.dtype, rows.device)
        if own_later and not self.gloo:
            raise ValueError("own_later needs point-to-point transfers (gloo): a collective reads every block at once")
        me = self.rank
        rows = rows.contiguous()
        sent = rows.split_with_sizes(send_splits)
        received = out.split_with_sizes(recv_splits)
        mine = received[me] if self.gloo else sent[me]

        def own_block_in_place():
            if own is not None:
                source, index = own
                take_rows(source, index.split_with_sizes(send_splits)[me], out=mine)
            elif self.gloo and not own_later:
                mine.copy_(sent[me])
        if not self.gloo:
            own_block_in_place()            # the collective reads it
            work = dist.all_to_all_single(out, rows, recv_splits, send_splits, group=self.group, async_op=True)
            return Transfer(out, [work], own_rows=mine)
        # Point-to-point: the other members' blocks are posted first, so they are on the wire
        # while this rank copies its own block into place.
        if pieces == 1:
            tag = self.reserve_tags(1)
            recvs = [(received[p], p, tag) for p, c in enumerate(recv_splits) if c and p != me]
            sends = [(sent[p], p, tag) for p, c in enumerate(send_splits) if c and p != me]
            transfer = Transfer(out, self.post(sends, recvs), own_rows=mine)
            own_block_in_place()
            return transfer
        tag = self.reserve_tags(pieces)
        sends = [(sent[p][a:b], p, tag + j) for p, c in enumerate(send_splits) if p != me
                 for j, (a, b) in enumerate(piece_bounds(c, pieces, piece_rows)) if b > a]
        starts = [0] + list(accumulate(recv_splits))
        bounds = {p: [(starts[p] + a, starts[p] + b, j) for j, (a, b) in enumerate(piece_bounds(c, pieces, piece_rows))
                      if b > a]
                  for p, c in enumerate(recv_splits) if p != me}
        recvs = [(out[a:b], p, tag + j) for p, listed in bounds.items() for a, b, j in listed]
        works = self.post(sends, recvs)
        own_block_in_place()
        landing = iter(Transfer(out[a:b], [work]) for (a, b, j), work in
                       zip([piece for listed in bounds.values() for piece in listed], works))
        received_pieces = [(a, b, next(landing)) for listed in bounds.values() for a, b, _ in listed]
        transfer = Transfer(out, [t for _, _, t in received_pieces] + works[len(recvs):], own_rows=mine)
        transfer.pieces = received_pieces
        return transfer

    def all_to_all_fixed(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> Transfer:
        """Start an all-to-all of equal blocks whose size every member knows without being told
        (fixed buffers, a fixed-width control row): ``rows [P * B, C]`` -> [P * B, C], block p
        to member p (into ``out`` when given). Because every member sees the same block size,
        all choose alike between gloo's own all-to-all, for blocks of at most
        `COLLECTIVE_MAX_BLOCK_BYTES` (one call posts it, where point-to-point transfers cost a
        call per peer and direction), and `all_to_all`'s transfers for larger blocks
        (docs/decisions.md: Small fixed blocks through gloo's all-to-all)."""
        blocks = [rows.shape[0] // self.size] * self.size
        if self.size == 1 or not self.gloo or blocks[0] * rows[:1].nbytes > COLLECTIVE_MAX_BLOCK_BYTES:
            return self.all_to_all(rows, blocks, blocks, out=out)
        if out is None:
            out = allocate(rows.shape, rows.dtype, rows.device)
        work = dist.all_to_all_single(out, rows.contiguous(), group=self.group, async_op=True)
        return Transfer(out, [work])

    def pieces_back(self, out: torch.Tensor, send_splits: list, recv_splits: list, pieces: int,
                    piece_rows: int = MIN_PIECE_ROWS) -> "PieceSends":
        """The reverse of a ``pieces`` all-to-all whose rows are computed piece by piece: every
        piece to receive is posted now (into ``out [sum(recv_splits), C]``), each piece to send
        when the caller has it (`PieceSends.send`). gloo only."""
        tag = self.reserve_tags(pieces)
        starts = [0] + list(accumulate(recv_splits))
        recvs = [(out[starts[p] + a:starts[p] + b], p, tag + j) for p, c in enumerate(recv_splits) if p != self.rank
                 for j, (a, b) in enumerate(piece_bounds(c, pieces, piece_rows)) if b > a]
        return PieceSends(self, tag, Transfer(out, self.post([], recvs)),
                          out[starts[self.rank]:starts[self.rank + 1]])

    def all_gather(self, rows: torch.Tensor, counts: list) -> Transfer:
        """Start gathering every member's rows; the Transfer yields them concatenated in member
        order, [sum(counts), C]. Members send ``max(counts)`` rows each (padding)."""
        if self.size == 1:
            return Transfer(rows)
        most = max(counts)
        padded = allocate((most, *rows.shape[1:]), rows.dtype, rows.device)
        padded[:rows.shape[0]] = rows
        padded[rows.shape[0]:] = 0
        out = allocate((len(counts) * most, *rows.shape[1:]), rows.dtype, rows.device)
        work = all_gather_single(out, padded, group=self.group, async_op=True)
        if all(c == most for c in counts):
            return Transfer(out, [work])
        keep = torch.cat([torch.arange(p * most, p * most + c, device=rows.device) for p, c in enumerate(counts)])
        return Transfer(out, [work], lambda full: full.index_select(0, keep))


def pieces_used(count: int, pieces: int, min_rows: int = MIN_PIECE_ROWS) -> int:
    """How many of ``pieces`` a block of ``count`` rows is cut into: as many as keep each piece
    at least ``min_rows`` rows, at least one."""
    return max(1, min(pieces, count // max(1, min_rows)))


def piece_bounds(count: int, pieces: int, min_rows: int = MIN_PIECE_ROWS) -> list[tuple[int, int]]:
    """(start, end) of each of the ``pieces`` pieces a block of ``count`` rows travels in: the
    block cut into `pieces_used` near-equal consecutive pieces (the larger first), the rest
    empty. Sender and receiver compute it alike from the block's size."""
    used = pieces_used(count, pieces, min_rows)
    base, extra = divmod(count, used)
    ends = list(accumulate(base + (j < extra) for j in range(used))) + [count] * (pieces - used)
    return list(zip([0] + ends[:-1], ends))


class PieceSends:
    """A pieces all-to-all whose receives are posted and whose sends are posted one piece at a
    time, as the caller computes them (`Channel.pieces_back`). ``transfer``: every piece
    received; wait for it only once every piece has been sent. ``own_rows``: the block this
    rank sends itself, to be filled in place by the caller."""

    def __init__(self, channel: Channel, tag: int, transfer: Transfer, own_rows: torch.Tensor):
        self.channel, self.tag, self.transfer, self.own_rows = channel, tag, transfer, own_rows

    def send(self, member: int, piece: int, rows: torch.Tensor) -> None:
        """Post piece ``piece`` of the block to ``member``: ``rows`` [piece rows, C]."""
        if rows.shape[0]:
            self.transfer._works += self.channel.post([(rows, member, self.tag + piece)], [])


@dataclass
class LandingRuns:
    """An all-to-all whose received rows land straight in their final places.

    The sent rows and the landing buffer are each cut into consecutive pieces: ``send_sizes``
    / ``recv_sizes`` rows each (gaps, e.g. padding, are pieces too). ``send[p]`` / ``recv[p]``
    number the pieces exchanged with member p of the channel, matched in order (piece j sent
    to p is piece j received from us). ``out_rows``: rows of the landing buffer; ``zero_fill``:
    it has padding rows that must read as zeros. The exchange is a batch of point-to-point
    transfers, one per non-empty piece (the pieces to this rank are copies).
    """

    send_sizes: list
    recv_sizes: list
    send: list
    recv: list
    channel: Channel
    out_rows: int
    zero_fill: bool

    def local_block(self) -> tuple:
        """(start, end) of the sent rows that stay on this rank (consecutive pieces)."""
        mine = self.send[self.channel.rank]
        if not mine:
            return 0, 0
        start = sum(self.send_sizes[:mine[0]])
        return start, start + sum(self.send_sizes[mine[0]:mine[-1] + 1])

    def exchange(self, rows: torch.Tensor, forward: bool, source: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> Transfer:
        """Forward: rows [sum(send_sizes), C] -> landing [out_rows, C]; backward the reverse.
        With ``source`` and ``index`` (forward), the rows that stay on this rank are gathered
        from ``source[index]`` straight into place (their pieces of ``rows`` are not read)."""
        send, recv, send_sizes, recv_sizes = (self.send, self.recv, self.send_sizes, self.recv_sizes) if forward \
            else (self.recv, self.send, self.recv_sizes, self.send_sizes)
        out = (allocate_zeros if forward and self.zero_fill else allocate)((sum(recv_sizes), *rows.shape[1:]),
                                                                          rows.dtype, rows.device)
        sent, landing = rows.split_with_sizes(send_sizes), out.split_with_sizes(recv_sizes)  # views, one call each
        sends, recvs = [], []
        first_tag = self.channel.reserve_tags(max(len(pieces) for pieces in send))
        for p in range(self.channel.size):
            if p == self.channel.rank:
                rows_of = index.split_with_sizes(send_sizes) if source is not None else None
                for a, b in zip(send[p], recv[p]):
                    if source is not None:
                        take_rows(source, rows_of[a], out=landing[b])
                    else:
                        landing[b].copy_(sent[a])
                continue
            sends += [(sent[a], p, first_tag + j) for j, a in enumerate(send[p]) if send_sizes[a]]
            recvs += [(landing[b], p, first_tag + j) for j, b in enumerate(recv[p]) if recv_sizes[b]]
        return Transfer(out, self.channel.post(sends, recvs))


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


def link_class(me: int, peer: int, domain_size: int) -> str:
    """The link class between EP ranks ``me`` and ``peer`` for domains of ``domain_size`` ranks."""
    if peer == me:
        return "self"
    return "intra" if peer // domain_size == me // domain_size else "inter"
