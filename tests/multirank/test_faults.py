"""A rank that dies or stops calling in: every other rank raises, naming the operation and the
group, within twice the timeout; nothing hangs. Each case gets its own pool (it breaks it)."""
import re

import pytest

import expertrail as er
from expertrail.emulation.launch import LocalRanks, RankDied, RankError

import faults_ranks

TIMEOUT = 4.0


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_other_ranks_raise_within_twice_the_timeout(mode):
    with LocalRanks(4, timeout=60) as ranks:
        with pytest.raises(RankError) as info:
            ranks.run(faults_ranks.fault_during_dispatch, mode, TIMEOUT)
    errors = info.value.errors
    for rank in (0, 1, 2):
        exc = errors[rank][2]
        assert isinstance(exc, er.CollectiveError), errors[rank][1]
        text = str(exc)
        assert "hierarchical dispatch on the EP group of global ranks [0, 1, 2, 3] failed" in text
        assert "a rank of the group probably exited or stopped calling" in text
        elapsed = float(re.search(r"after ([0-9.]+) s", text).group(1))
        assert elapsed <= 2 * TIMEOUT, text
        # Later calls on the broken groups (a dispatch, a new dispatcher) raise at once and say why.
        first, *later = text.split(" || ")
        assert "destroy it (torch.distributed.destroy_process_group())" in first
        assert len(later) == 2, text
        for message in later:
            assert "cannot run: an earlier collective on these groups failed (hierarchical dispatch" in message
            assert "build new EPGroups" in message
            assert float(re.search(r"\[after ([0-9.]+) s\]", message).group(1)) < 0.5, message
    if mode == "die":
        assert isinstance(errors[3][2], RankDied) and "exited with code 17" in str(errors[3][2])
    else:
        assert 3 not in errors
