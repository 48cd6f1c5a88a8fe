"""How a dispatcher's ranks agree before anything can go wrong: every dispatch starts with one
all-to-all of the counts each peer will receive plus this rank's `Header` (token count, hidden
size, top-k, dtype, gradient needs, error kind), and every combine sends a flags row (error
kind, gradient needs) to each peer just before its rows. Every rank reads them once they land
and, if any rank is in error or the calls do not match, all raise at the same point: no rank
waits for a peer that will not come."""
from __future__ import annotations

import torch

from ..comm.topology import EPGroups
from ..comm.transport import Transfer
from ..errors import InvalidInputError
from .header import ERROR_KINDS, FIELDS, Headers


class Agreement:
    """The control exchanges of one dispatcher (``name``, on ``groups``; ``count_columns``
    counts per peer in a dispatch's control row)."""

    def __init__(self, name: str, groups: EPGroups, count_columns: int):
        self.name, self.groups, self.count_columns = name, groups, count_columns

    def no_counts(self) -> torch.Tensor:
        """int64 [P, C] zeros: the counts of a rank in error."""
        return torch.zeros(self.groups.ep_size, self.count_columns, dtype=torch.int64, device=self.groups.device)

    def start(self, counts: torch.Tensor, header: list) -> Transfer:
        """Start the all-to-all of counts [P, C] plus ``header`` (int64 values, the same to every
        peer: a packed `Header`, or combine's flags)."""
        head = torch.tensor(header, dtype=torch.int64)
        if counts.device.type == "cuda":      # copied from pinned memory, the row does not wait for the GPU
            head = head.pin_memory()
        head = head.to(counts.device, non_blocking=True).expand(self.groups.ep_size, -1)
        return self.groups.control_channel.all_to_all_fixed(torch.cat([counts, head], 1))

    def finish_dispatch(self, transfer: Transfer, message: str | None) -> tuple[torch.Tensor, Headers]:
        """Wait for the control exchange -> (recv_counts [P, C], every rank's `Headers`); raise
        on every rank if any rank is in error or the calls do not match. The host reads the
        headers and plans with the counts from one copy (``headers.counts``): one wait for the GPU."""
        recv = transfer.wait()
        host = recv.cpu()
        recv_counts, headers = recv[:, :-len(FIELDS)], Headers(host[:, -len(FIELDS):], host[:, :-len(FIELDS)])
        self.raise_if_any(headers.column("error").tolist(), message, "dispatch", "input")
        headers.check(self.name)
        return recv_counts, headers

    def start_combine(self, error: int, needs_grad: bool) -> Transfer:
        """Send every EP peer this rank's combine flags (error kind, needs gradients): one int64
        row per peer, posted just before the rows.

        The rows themselves cannot carry them: a rank in error still sends rows of the agreed
        shape (zeros), and every rank reads the flags when the first reverse exchange has landed,
        before anything else is sent, so all ranks stop at the same point. Cost: one small
        message per peer beside the rows, no extra round trip (benchmarks/combine_flags.py).
        """
        no_counts = torch.empty(self.groups.ep_size, 0, dtype=torch.int64, device=self.groups.device)
        return self.start(no_counts, [error, int(needs_grad)])

    def finish_combine(self, flags: Transfer, message: str | None) -> None:
        """Wait for the peers' combine flags; raise on every rank if any rank is in error or the
        ranks disagree on gradients."""
        received = flags.wait().cpu()          # both columns read on the host: one wait for the GPU
        self.raise_if_any(received[:, 0].tolist(), message, "combine", "expert_out")
        grads = received[:, 1].tolist()
        if len(set(grads)) > 1:
            shown = ", ".join(f"rank {r}={bool(g)}" for r, g in enumerate(grads))
            raise InvalidInputError(
                f"{self.name} combine: whether gradients are needed differs across EP ranks ({shown}); "
                "combine's backward is collective, so every rank must combine with expert outputs (or weights) "
                "that require grad alike, under the same torch.no_grad() setting")

    def raise_if_any(self, errors: list, message: str | None, verb: str, subject: str) -> None:
        """Raise on every rank if any EP rank reported an error kind (``errors``, one per EP
        rank): this rank's own ``message`` where it is the one in error, else the ranks to look at."""
        if any(errors):
            if message:
                raise InvalidInputError(message)
            bad = ", ".join(f"EP rank {r} ({ERROR_KINDS.get(c, c)})" for r, c in enumerate(errors) if c)
            raise InvalidInputError(f"{self.name} {verb} aborted on EP rank {self.groups.ep_rank}: invalid {subject} "
                                    f"on {bad}; see the error raised on that rank")
