"""The GPU measurement scripts run their checks on the CPU (their timings need a GPU)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.docs
def test_gemm_efficiency_script_checks_every_timed_kernel():
    out = run("gpu_gemm_efficiency.py", "--tokens", "64", "--rows", "16", "--seq", "64", "--iters", "1",
              "--local-experts", "2", "--models", "qwen3-30b-a3b,deepseek-v3")
    rows = [line for line in out.splitlines() if line.startswith(("qwen3-30b-a3b", "deepseek-v3"))]
    # per model: projections, one rows-per-expert size, FP8, attention
    assert len(rows) == 2 * 4, out
    assert all(" ok " in line for line in rows), out


@pytest.mark.docs
def test_overlap_sms_script_checks_every_timed_gemm():
    out = run("gpu_overlap_sms.py", "--rows", "16,32", "--local-experts", "2", "--tokens", "32", "--iters", "1")
    checks = [line for line in out.splitlines() if line.startswith("check ")]
    assert len(checks) == 2 * 3 and all(line.endswith(": ok") for line in checks), out


def test_overlap_sms_model_column_is_the_estimators_pair():
    """The script's 'model' column is `estimate.ep_overlap_exposed` for one chunk pair."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_overlap_sms as script
    finally:
        sys.path.remove(str(BENCHMARKS))
    from expertrail.plan import estimate as est
    gemm, hold, k, sms = 3.0, 1.5, 20, 132
    # four exchanges of ``hold``: two beside MLP chunks of at least ``gemm``, two beside no attention
    exposed = (est.ep_overlap_exposed(4 * hold, 0.0, 3 * gemm, True, k / sms) - 2 * hold) / 2
    assert script.modelled_pair(gemm, hold, sms, k) == pytest.approx(gemm + exposed)
    assert script.modelled_pair(gemm, 2 * gemm, sms, k) > 2 * gemm     # a hold longer than the GEMM shows


@pytest.mark.docs
def test_host_syncs_script_checks_every_backend_against_alltoall():
    out = run("gpu_host_syncs.py", "--tokens", "64", "--experts", "8", "--topk", "2", "--hidden", "128",
              "--ffn", "64", "--iters", "1")
    for backend in ("alltoall", "dedup", "allgather", "hierarchical"):
        assert any(line.startswith(backend) and " ok " in line for line in out.splitlines()), out


@pytest.mark.docs
def test_gated_delta_net_script_checks_its_kernels_on_the_cpu():
    out = run("gpu_gated_delta_net.py", "--seq", "96", "--iters", "1", "--micro-batches", "1")
    rows = [line for line in out.splitlines() if line.startswith("torch chunked")]
    assert len(rows) == 3 and all(" ok " in line for line in rows), out     # delta rule, convolution, both


def test_chunked_gated_delta_rule_is_the_recurrence():
    """The script's chunked form against the token-by-token rule: a sequence that is not a whole
    number of chunks, outputs and gradients; a wrong decay fails the check."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_gated_delta_net as script
    finally:
        sys.path.remove(str(BENCHMARKS))
    import torch
    cpu = torch.device("cpu")
    assert script.check_rule(script.chunked_gated_delta_rule, cpu, torch.float32, 2, 8, 4, 70)
    wrong_decay = lambda q, k, v, g, beta: script.chunked_gated_delta_rule(q, k, v, 0.9 * g, beta, chunk=16)  # noqa: E731
    assert not script.check_rule(wrong_decay, cpu, torch.float32, 2, 8, 4, 40)
