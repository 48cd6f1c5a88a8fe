"""Settings of the `expertrail bench` and `expertrail train` commands (no torch import, so
the command line can be built without it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..names import BACKEND_NAMES

DTYPE_NAMES = ("bf16", "fp16", "fp32")


@dataclass
class BenchConfig:
    """What `expertrail bench` runs. Sizes are per rank; defaults follow the Hybrid-EP test
    (uniform top-8 routing, BF16 tokens) at a size a 2-core CPU finishes in about a minute."""

    world: int = 4
    domain_size: int = 2
    hidden: int = 2048
    tokens: int = 1024
    experts: int = 16
    topk: int = 8
    backends: list = field(default_factory=lambda: sorted(BACKEND_NAMES))
    dtype: str = "bf16"
    routing: str = "uniform"
    iters: int = 10
    warmup: int = 2
    seed: int = 0
    chunks: int = 1
    expert_ffn: int = 256
    progress: bool = True
    payload: str = "native"        # or "fp8": dispatch rows as float8 e4m3 + per-128 scales
    malloc_heap: bool = False      # the ranks' glibc set to keep large blocks (see launch.py)
    pipeline_chunks: int | None = None   # hierarchical's pieces per rail block (None: its default)


@dataclass
class TrainConfig:
    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    experts: int = 8
    topk: int = 2
    ffn: int = 32
    seq: int = 16
    batch: int = 4            # sequences per rank per micro-batch
    micro_batches: int = 1    # per step, gradients accumulated
    overlap: bool = False     # also train with micro-batches overlapped (`schedule`), side by side
    steps: int = 20
    lr: float = 0.3
    aux_loss_coeff: float = 1e-2
    seed: int = 0
    tolerance: float = 1e-4   # largest |loss - single-process loss| `expertrail train` accepts
