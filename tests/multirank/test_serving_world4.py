"""The serving loop that rebalances live, on 4 real gloo ranks: same outputs as the unreplicated
layer at every step, better balance under drifting skew, the same replica choices everywhere."""
import numpy as np
import torch

from expertrail.balance import balancedness

import serving_ranks


def test_rebalancing_while_serving_keeps_outputs_and_balances(world4):
    results = world4.run(serving_ranks.serve_and_compare)
    rows = sum(r[0] for r in results)                                # [2, steps, P] over all senders
    static, live = (balancedness(rows[i].double().numpy()) for i in range(2))
    events = results[0][1]
    assert all(r[1] == events for r in results)
    assert [s for s, e in enumerate(events) if e in ("migrate", "reweight")] == [9, 19, 29]
    assert results[0][4] >= 1                                        # weights did move at least once
    assert live[10:].mean() > static[10:].mean() + 0.1, (live, static)
    for r in results[1:]:                                            # same token, same replica, every rank
        assert torch.equal(r[2], results[0][2]) and torch.equal(r[3], results[0][3])
    assert np.isfinite(static).all()
