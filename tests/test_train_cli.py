"""`expertrail train`: every backend's expert-parallel training equals one process, loss falls."""
import json
import subprocess
import sys

import pytest

from expertrail import BACKENDS

pytestmark = pytest.mark.multirank


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


def test_summary_names_the_first_step_beyond_the_tolerance():
    from expertrail.tools.configs import TrainConfig
    from expertrail.tools.train import summarize
    runs = {name: {"sequential": {"losses": losses, "step_times": [1.0] * 4, "cpu_floors": [0.5] * 4}}
            for name, losses in (("ok", [4.0, 3.0, 2.0, 1.0 + 5e-5]), ("off", [4.0, 3.0, 2.1, 1.0]),
                                 ("nan", [4.0, float("nan"), 2.0, 1.0]))}
    report = summarize(TrainConfig(tolerance=1e-4), [4.0, 3.0, 2.0, 1.0], runs)["backends"]
    assert report["ok"]["matches_reference"] and report["ok"]["first_bad_step"] is None
    assert report["off"]["first_bad_step"] == 2 and not report["off"]["matches_reference"]
    assert report["nan"]["first_bad_step"] == 1


def test_failing_train_names_the_backend_and_says_why():
    out = subprocess.run([sys.executable, "-m", "expertrail", "train", "--world", "2", "--steps", "1",
                          "--experts", "3", "--backends", "dedup"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "FAILED: dedup raised on rank(s) [0, 1]" in out.stderr and "num_experts=3" in out.stderr, out.stderr


def test_train_help_describes_every_option_with_its_default():
    out = subprocess.run([sys.executable, "-m", "expertrail", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for option, default in (("--steps", "20"), ("--tolerance", "0.0001"), ("--world", "4"), ("--lr", "0.3")):
        options = out.stdout[out.stdout.index("options:"):]
        described = " ".join(options[options.index(f"  {option} "):].split()[:40])
        assert f"default {default}" in described, (option, described)


def test_train_overlap_reports_both_runs_with_identical_losses(tmp_path):
    path = tmp_path / "train.json"
    out = subprocess.run([sys.executable, "-m", "expertrail", "train", "--overlap", "--micro-batches", "2", "--steps",
                          "3", "--world", "2", "--backends", "alltoall,dedup", "--json", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(path.read_text())
    assert report["config"]["overlap"] and report["config"]["micro_batches"] == 2
    for name, r in report["backends"].items():
        assert len(r["losses"]) == 3 and r["step_time_s"] > 0, name
        assert r["same_losses"] and r["losses"] == r["without_overlap"]["losses"], name
        assert r["max_abs_diff"] <= 1e-4, name
        assert r["overlap_speedup"] == r["without_overlap"]["step_time_s"] / r["step_time_s"]
        assert 0 < r["cpu_floor_s"] and r["overlap_ceiling"] == r["without_overlap"]["step_time_s"] / r["cpu_floor_s"]
        assert 0 < r["without_overlap"]["cpu_floor_s"], name
    assert "losses identical: yes" in out.stdout
    assert "overlap can gain at most" in out.stdout


def test_cpu_floor_is_the_busiest_core_sets_cpu_time_over_its_cores():
    from expertrail.tools.train import floor_per_step
    ranks = [("a", 2, [1.0, 2.0]), ("a", 2, [3.0, 4.0]), ("b", 4, [6.0, 1.0]), ("b", 4, [2.0, 3.0])]
    assert floor_per_step(ranks) == [2.0, 3.0]          # host a: [4, 6] / 2; host b: [8, 4] / 4
    # two emulated nodes on one host, each pinned to a core of its own: not one pool of two cores
    pinned = [(("h", (0,)), 1, [1.0, 2.0]), (("h", (1,)), 1, [3.0, 1.0])]
    assert floor_per_step(pinned) == [3.0, 2.0]


def test_overlap_needs_two_micro_batches():
    out = subprocess.run([sys.executable, "-m", "expertrail", "train", "--overlap", "--micro-batches", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--overlap needs at least 2 micro-batches" in out.stderr, out.stderr
