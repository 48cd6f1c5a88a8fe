"""The README's runnable examples run and check themselves."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["quickstart.py", "hf_expert_parallel.py"])
def test_example_runs(script):
    out = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")
