"""Megatron-Core's alltoall token dispatcher against expertrail's `alltoall`, in one invocation.

Runs the peer (``../shared/peers/megatron_alltoall_cpu.py`` in the peers' virtualenv that
``../shared/peers/setup.sh`` builds: Megatron-Core's MoEAlltoAllTokenDispatcher on 4 gloo
processes, dispatch -> per-expert scale -> combine at 4096 tokens per rank, hidden 1024, 16
experts, top-2, fp32 then bf16, mean of ``--iters`` calls after a warm-up; ``--tokens`` and
``--hidden`` change the sizes of both), then
``benchmarks/user_process.py --backends alltoall`` in fp32 and in bf16 with the same sizes and
call count (the same plain spawned processes, default allocator, with the bare
``all_to_all_single`` of the same rows out and back timed beside it), and prints both.

    bash ../shared/peers/setup.sh
    .venv/bin/python benchmarks/against_megatron.py [--json docs/results/against-megatron.json]

``--json`` writes the record: the command, the machine, the date, the peer's command, versions and
timings, and both user_process records.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import user_process  # noqa: E402  (benchmarks/user_process.py)

from expertrail.tools.records import code, machine, now  # noqa: E402

TIMING = re.compile(r"^\[timing\] megatron (\w+)\s+dispatch\+scale\+combine .* torch\.(float32|bfloat16): "
                    r"([\d.]+) ms/iter$")
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def run_peer(python: str, script: str, iters: int, tokens: int, hidden: int) -> dict:
    """The peer's timings (ms per call, per dispatcher and dtype) and versions, as it prints them."""
    env = dict(os.environ, BENCH_ITERS=str(iters), BENCH_TOKENS=str(tokens), BENCH_HIDDEN=str(hidden))
    out = subprocess.run([python, script], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the peer failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    ms: dict = {}
    for line in out.stdout.splitlines():
        m = TIMING.match(line.strip())
        if m:
            ms.setdefault(m.group(1), {})[DTYPES[m.group(2)]] = float(m.group(3))
    versions = next((line.strip() for line in out.stdout.splitlines() if line.startswith("torch ")), "")
    if "alltoall" not in ms or set(ms["alltoall"]) != {"fp32", "bf16"}:
        raise SystemExit(f"no alltoall timings in the peer's output:\n{out.stdout[-2000:]}")
    return {"command": f"BENCH_ITERS={iters} BENCH_TOKENS={tokens} BENCH_HIDDEN={hidden} {python} {script}", "versions": versions, "ms": ms,
            "output": out.stdout.splitlines()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", default="/tmp/peers-venv/bin/python")
    p.add_argument("--peer-script", default=str(HERE.parent.parent / "shared" / "peers" / "megatron_alltoall_cpu.py"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (both sides)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (both sides)")
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not Path(args.peer_python).exists() or not Path(args.peer_script).exists():
        print(f"needs {args.peer_python} and {args.peer_script}: run `bash ../shared/peers/setup.sh` first",
              file=sys.stderr)
        return 2
    peer = run_peer(args.peer_python, os.path.relpath(args.peer_script), args.iters, args.tokens, args.hidden)
    ours = {}
    for dtype in ("fp32", "bf16"):
        ua = ["--dtype", dtype, "--backends", "alltoall", "--iters", str(args.iters), "--tokens", str(args.tokens),
              "--hidden", str(args.hidden)]
        u = user_process.parser().parse_args(ua)
        u.argv = ua
        ours[dtype] = user_process.run(u)
    record = {"command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/against_megatron.py", *argv]),
              "machine": machine(), "date": now(), "code": code(),
              "iters": args.iters, "peer": peer, "expertrail": ours}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    from expertrail.tools.records import against_megatron_table
    print(against_megatron_table(record), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
