"""LoadRecorder windows and replica routing determinism (single process)."""
import numpy as np
import pytest
import torch

from expertrail.balance import LoadRecorder, ReplicaRouter, plan_placement
from expertrail.errors import ExpertrailError


def test_step_window_keeps_the_last_steps():
    rec = LoadRecorder(2, 4, window_steps=2)
    for step in range(3):
        rec.record(0, torch.tensor([step, 1, 0, 0]))
        rec.record(1, torch.tensor([0, 0, 0, step]))
        rec.step()
    assert rec.load().tolist() == [[1 + 2, 2, 0, 0], [0, 0, 0, 3]]


def test_seconds_window_forgets_old_steps():
    now = [0.0]
    rec = LoadRecorder(1, 2, window_seconds=300, clock=lambda: now[0])
    rec.record(0, torch.tensor([5, 0]))
    rec.step()
    now[0] = 200.0
    rec.record(0, torch.tensor([0, 7]))
    rec.step()
    assert rec.load().tolist() == [[5, 7]]
    now[0] = 350.0                                       # the first step is now 350 s old
    assert rec.load().tolist() == [[0, 7]]


def test_load_before_any_step_says_to_call_step():
    now = [0.0]
    rec = LoadRecorder(1, 2, window_seconds=10, clock=lambda: now[0])
    rec.record(0, torch.tensor([3, 4]))
    with pytest.raises(ExpertrailError, match=r"LoadRecorder.load\(\) before any step\(\): load\(\) sums closed steps "
                                              r"only, and 7 recorded token\(s\) are still in the open step; call "
                                              r"recorder.step\(\) at the end of each training or serving step"):
        rec.load()
    rec.step()
    assert rec.load().tolist() == [[3, 4]]
    now[0] = 60.0                                        # stepped, but nothing in the window: zeros, no error
    assert rec.load().tolist() == [[0, 0]]


def test_replica_routing_is_deterministic_and_even():
    load = np.array([100.0, 1.0, 1.0, 1.0])
    p = plan_placement(load, 8, 4)
    router = ReplicaRouter.from_placement(p)
    idx = torch.zeros(4000, 2, dtype=torch.long)
    idx[:, 1] = -1
    first, second = router(idx), router(idx.clone())
    assert torch.equal(first, second) and (first[:, 1] == -1).all()
    used = torch.bincount(first[:, 0], minlength=8)[torch.as_tensor(p.log_to_phys[0, 0][:p.replicas[0, 0]])]
    assert used.sum() == 4000 and used.min() > 0.8 * 4000 / len(used)
