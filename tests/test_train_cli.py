"""`expertrail train`: every backend's expert-parallel training equals one process, loss falls."""
import json
import subprocess
import sys

from expertrail import BACKENDS


def test_train_matches_single_process_for_every_backend(tmp_path):
    out = subprocess.run([sys.executable, "-m", "expertrail", "train", "--steps", "20", "--json",
                          str(tmp_path / "train.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "train.json").read_text())
    assert set(report["backends"]) == set(BACKENDS) and len(report["reference"]) == 20
    for name, r in report["backends"].items():
        assert len(r["losses"]) == 20
        assert r["max_abs_diff"] <= 1e-4, name
        assert r["losses"][-1] < 0.5 * r["losses"][0], name      # it learns the token rule
