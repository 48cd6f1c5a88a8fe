"""Soak: many dispatch/combine iterations with shapes changing every iteration on 4 local ranks;
resident memory after warm-up must not grow by more than 5%.

    .venv/bin/python benchmarks/soak.py [--iters 10000] [--world 4] [--json PATH]

Every iteration picks, from a seed shared by the ranks, the backend, the hidden size, top-k and
alignment, and each rank its own token count (0 included); it checks combine against the
expected sum on a cheap expert (scale by 2) every 500 iterations.
"""
import argparse
import datetime
import json
import platform
import random
import sys

import torch

import expertrail as er
from expertrail.emulation.launch import LocalRanks


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def soak(rank, world, iters, warmup):
    groups = er.EPGroups.from_default(domain_size=2)
    dispatchers = {(b, a): er.make_dispatcher(b, groups, num_experts=16, expert_alignment=a)
                   for b in sorted(er.BACKENDS) for a in (1, 8)}
    shared = random.Random(1234)
    mine = random.Random(rank)
    after_warmup = None
    samples = []
    for it in range(iters):
        backend, align = shared.choice(sorted(er.BACKENDS)), shared.choice((1, 8))
        hidden, topk = shared.choice((8, 24, 64)), shared.choice((1, 2, 4))
        n = mine.choice((0, 1, 5, 17, 64))
        x = torch.randn(n, hidden)
        idx = torch.randint(-1, 16, (n, topk))
        w = torch.rand(n, topk)
        d = dispatchers[(backend, align)]
        res = d.dispatch(x, idx, w)
        y = d.combine(res.tokens * 2, res)
        if it % 500 == 0:
            expected = 2 * (x.unsqueeze(1) * (w * (idx >= 0)).unsqueeze(2)).sum(1)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        if it == warmup:
            after_warmup = rss_mb()
        if it % 1000 == 0:
            samples.append(round(rss_mb(), 1))
    return after_warmup, rss_mb(), samples


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--json", metavar="PATH", help="write the figures, the command, machine and date as JSON")
    args = p.parse_args()
    with LocalRanks(args.world, timeout=3600) as ranks:
        results = ranks.run(soak, args.iters, args.warmup)
    worst = 0.0
    for rank, (start, end, samples) in enumerate(results):
        growth = (end - start) / start
        worst = max(worst, growth)
        print(f"rank {rank}: RSS after warm-up {start:.1f} MB, after {args.iters} iterations {end:.1f} MB "
              f"({growth:+.1%}); every 1000: {samples}")
    print(f"worst growth {worst:+.1%} (bar: <= +5%)")
    if args.json:
        record = {"command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
                  "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
                  "date": datetime.date.today().isoformat(), "iters": args.iters, "warmup": args.warmup,
                  "ranks": [{"rss_after_warmup_MB": start, "rss_end_MB": end, "every_1000_MB": samples}
                            for start, end, samples in results], "worst_growth": worst}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    raise SystemExit(0 if worst <= 0.05 else 1)


if __name__ == "__main__":
    main()
