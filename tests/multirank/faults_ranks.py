"""Functions run on every rank by tests/multirank/test_faults.py: fn(rank, world, ...)."""
from __future__ import annotations

import expertrail as er

from scenarios import make_inputs


def fault_during_dispatch(rank, world, mode, timeout):
    """Rank 3 dies (``die``) or stops calling (``stall``) before a dispatch; the others must
    raise a CollectiveError naming the operation within twice the timeout."""
    import os
    import time
    groups = er.EPGroups.from_default(domain_size=2, timeout=timeout)
    d = er.make_dispatcher("hierarchical", groups, num_experts=8)
    xs, idxs, ws = make_inputs("random", world, 8, 8, 2, 0)
    d.dispatch(xs[rank], idxs[rank], ws[rank])               # all healthy once
    if rank == 3:
        if mode == "die":
            os._exit(17)
        time.sleep(2.5 * timeout)
        return "stalled"
    start = time.monotonic()
    try:
        d.dispatch(xs[rank], idxs[rank], ws[rank])
    except er.ExpertrailError as err:
        first = f"{err} [after {time.monotonic() - start:.2f} s]"
    else:
        return "no error"
    # The groups are broken now: a later call and a new dispatcher on them raise at once.
    later = []
    for call in (lambda: d.dispatch(xs[rank], idxs[rank], ws[rank]),
                 lambda: er.make_dispatcher("dedup", groups, num_experts=8)):
        start = time.monotonic()
        try:
            call()
        except er.CollectiveError as err:
            later.append(f"{err} [after {time.monotonic() - start:.2f} s]")
    raise er.CollectiveError(" || ".join([first, *later]))
