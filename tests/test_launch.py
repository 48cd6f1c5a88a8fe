"""LocalRanks' processes end with their owner, also when it is killed without cleanup."""
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
