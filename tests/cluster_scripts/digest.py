"""Run by the cluster loss test on every rank: every backend's dispatch, combine and backward on
fixed inputs; writes the SHA-256 of all their bytes to <out dir>/rank<r>.sha."""
import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import expertrail as er


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = er.EPGroups.from_default()
    digest = hashlib.sha256()
    g = torch.Generator().manual_seed(rank)
    for backend in sorted(er.BACKENDS):
        d = er.make_dispatcher(backend, groups, num_experts=4 * world, hidden=128)
        x = torch.randn(512, 128, generator=g, dtype=torch.float32).bfloat16().requires_grad_()
        idx = torch.randint(0, 4 * world, (512, 4), generator=g)
        w = torch.rand(512, 4, generator=g).requires_grad_()
        res = d.dispatch(x, idx, w)
        y = d.combine(res.tokens * 2, res)
        y.float().square().sum().backward()
        for t in (res.tokens, y, x.grad, w.grad):
            digest.update(t.detach().float().numpy().tobytes())
    (Path(sys.argv[1]) / f"rank{rank}.sha").write_text(digest.hexdigest())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
