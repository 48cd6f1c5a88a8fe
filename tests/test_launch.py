"""Ranks end cleanly: LocalRanks' processes with their owner, also when it is killed without
cleanup; a rank's process groups before the interpreter finalizes."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multirank

OWNER = """
import operator, time
from expertrail.emulation.launch import LocalRanks
ranks = LocalRanks(2).__enter__()
assert ranks.run(operator.add) == [2, 3]
print(" ".join(str(p.pid) for p in ranks._procs), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie waiting for its reaper is gone too
        return f.read().split()[2] != "Z"


def test_ranks_exit_when_their_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)   # killed below
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:                                 # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} outlived their owner"


EXITING_RANK = """
import atexit, sys, weakref
import torch.distributed as dist
held = []

@atexit.register
def report():                 # registered before expertrail's own hook, so it runs after it
    print("freed" if held[0]() is None else "alive", flush=True)

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from expertrail.comm.topology import EPGroups
groups = EPGroups.from_default()          # one EP group: it keeps the default group itself
held.append(weakref.ref(groups.ep_group))
dist.destroy_process_group()
"""


def test_the_groups_an_epgroups_keeps_are_freed_before_the_interpreter_finalizes(tmp_path):
    """A gloo group freed during finalization aborts the process now and then (SIGABRT at the
    end of a torchrun job); the exit hook frees the groups an EPGroups still holds first."""
    done = subprocess.run([sys.executable, "-c", EXITING_RANK, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["freed"]


def test_released_groups_refuse_every_collective_saying_why():
    """After the exit hook released them (or anything else did), a collective on the groups
    raises at once instead of running on None, which torch reads as the default group."""
    import torch
    from expertrail.comm.topology import EPGroups, guarded
    from expertrail.errors import CollectiveError
    groups = EPGroups(ep_group=object(), ep_size=2, ep_rank=0, ep_ranks=(0, 1), domain_group=object(),
                      domain_size=2, rail_group=object(), device=torch.device("cpu"))
    groups.release("the process is exiting")
    assert groups.ep_group is None and groups.control_group is None
    with pytest.raises(CollectiveError, match=r"cannot run: its process groups were released \(the process is exiting\)"):
        with guarded("alltoall dispatch", groups):
            raise AssertionError("must not run")
