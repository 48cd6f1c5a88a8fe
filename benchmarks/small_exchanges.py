"""Small equal-block all-to-alls on gloo: point-to-point transfers against gloo's collective.

    .venv/bin/python benchmarks/small_exchanges.py [--ranks 4] [--sizes 256,4096,65536,524288] [--compute-ms 1]

Every rank sends each peer one block of ``size`` bytes (the same on every rank, as the
low-latency mode's fixed blocks and the normal mode's count exchange are), two ways, timed in
alternation: ``p2p``, one send and one receive per peer posted on the process group
(`Channel.post`); ``collective``, gloo's ``all_to_all_single``. Between exchanges each rank
computes for about ``compute-ms`` (a small matmul loop), so ranks contend for the cores as in a
decode step. Prints the median wall and process CPU per exchange (slowest rank) and their ratio.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from expertrail.comm.transport import Channel
from expertrail.emulation.launch import LocalRanks

MODES = ("p2p", "collective")


def exchange(rank, world, args):
    channel = Channel()
    a = torch.randn(64, 64)
    results = {}
    for size in args.sizes:
        send = torch.randint(0, 255, (world * size,), dtype=torch.uint8)
        recv = torch.empty_like(send)
        blocks = [size] * world

        def run(mode):
            if mode == "collective":
                dist.all_to_all_single(recv, send, blocks, blocks)
                return
            tag = channel.reserve_tags(1)
            peers = [q for q in range(world) if q != rank]
            for work in channel.post([(send[q * size:(q + 1) * size], q, tag) for q in peers],
                                     [(recv[q * size:(q + 1) * size], q, tag) for q in peers]):
                work.wait()

        def compute():
            end = time.perf_counter() + args.compute_ms / 1e3
            while time.perf_counter() < end:
                a @ a

        samples = {mode: [] for mode in MODES}
        for it in range(args.warmup + args.iters):
            for mode in MODES:                    # alternated, so both see the same moments
                compute()
                wall, cpu = time.perf_counter(), time.process_time()
                run(mode)
                if it >= args.warmup:
                    samples[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
        results[size] = {mode: [statistics.median(c) * 1e3 for c in zip(*s)] for mode, s in samples.items()}
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes", default="256,4096,65536,524288", help="bytes per peer, comma separated")
    p.add_argument("--compute-ms", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    with LocalRanks(args.ranks) as ranks:
        rows = ranks.run(exchange, args)
    print(f"{args.ranks} ranks, one block per peer, {args.compute_ms} ms of compute between exchanges; "
          "ms per exchange, median, slowest rank: wall / CPU of the process")
    print(f"{'bytes/peer':>11}{'p2p':>16}{'collective':>16}{'wall ratio':>12}")
    for size in args.sizes:
        worst = {m: [max(r[size][m][i] for r in rows) for i in range(2)] for m in MODES}
        print(f"{size:>11}" + "".join(f"{worst[m][0]:>9.3f} / {worst[m][1]:4.2f}" for m in MODES)
              + f"{worst['collective'][0] / worst['p2p'][0]:>12.2f}")


if __name__ == "__main__":
    main()
