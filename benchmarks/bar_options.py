"""Command-line options the CPU probes share: the bench's bar configuration by default."""
import argparse

from expertrail.tools.bench import DTYPES


def bar_configuration(description: str) -> argparse.ArgumentParser:
    """A parser with the shape options of the bar configuration (4 ranks, 2 domains, 4096 tokens
    per rank, hidden 1024, 16 experts, top-2, bf16) and the timing options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--domain-size", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p
