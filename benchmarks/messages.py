"""What landing rows in place costs in messages: pieces against whole blocks, on 4 gloo ranks.

    .venv/bin/python benchmarks/messages.py [--rows-per-peer 2048] [--hidden 1024] [--pieces 4]

Every rank sends ``rows-per-peer`` bf16 rows to each other rank, three ways, timed in
alternation (wall and process CPU per rank, median):
- ``pieces``: one message per (peer, piece) that lands straight in its expert-major place
  (what `alltoall`'s `LandingRuns` do, a piece per local expert);
- ``blocks``: one message per peer into a contiguous block (what a plain all-to-all does,
  leaving the rows in source order);
- ``blocks+copy``: the blocks, then each piece copied to its expert-major place.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from expertrail.comm.transport import Channel
from expertrail.emulation.launch import LocalRanks

MODES = ("pieces", "blocks", "blocks+copy")


def exchange(rank, world, args):
    rows, pieces = args.rows_per_peer, args.pieces
    piece = rows // pieces
    send = torch.randn(world * rows, args.hidden).bfloat16()
    staging, landing = torch.empty_like(send), torch.empty_like(send)

    def landed(peer, j):          # piece j from ``peer`` in the expert-major buffer
        at = (j * world + peer) * piece
        return landing[at:at + piece]

    channel = Channel()

    def run(mode):
        tag = channel.reserve_tags(pieces)
        sends, recvs = [], []
        for peer in (q for q in range(world) if q != rank):
            block = slice(peer * rows, (peer + 1) * rows)
            if mode == "pieces":
                for j in range(pieces):
                    sends.append((send[block][j * piece:(j + 1) * piece], peer, tag + j))
                    recvs.append((landed(peer, j), peer, tag + j))
            else:
                sends.append((send[block], peer, tag))
                recvs.append((staging[block], peer, tag))
        for work in channel.post(sends, recvs):
            work.wait()
        if mode == "blocks+copy":
            for peer in (q for q in range(world) if q != rank):
                for j in range(pieces):
                    landed(peer, j).copy_(staging[peer * rows + j * piece:peer * rows + (j + 1) * piece])

    samples = {mode: [] for mode in MODES}
    for it in range(args.warmup + args.iters):
        for mode in MODES:                    # alternated, so all modes see the same moments
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            run(mode)
            if it >= args.warmup:
                samples[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {mode: [statistics.median(c) * 1e3 for c in zip(*s)] for mode, s in samples.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-per-peer", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--pieces", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    with LocalRanks(4) as ranks:
        rows = ranks.run(exchange, args)
    print(f"4 ranks, {args.rows_per_peer} bf16 rows of {args.hidden} to each peer in {args.pieces} pieces; "
          "ms per exchange, median: wall / CPU of the process")
    for mode in MODES:
        print(f"{mode:<12}" + "".join(f"   rank {r}: {row[mode][0]:5.1f} / {row[mode][1]:4.1f}" for r, row in enumerate(rows)))


if __name__ == "__main__":
    main()
