"""Tables in README.md and docs/ written from the JSON records under docs/results/, so that a
figure shown and its record cannot disagree.

A generated block sits in a Markdown file between two comments, which name the record (relative
to docs/) and how to show it:

    <!-- record: results/bench-default.json bench -->
    ```
    ...the table, as the command printed it...
    ```
    <!-- end record -->

``python -m expertrail.tools.records`` checks every block of README.md and docs/*.md against
its record (exit 1, naming the blocks that differ); ``--write`` writes them anew. The test suite
runs the check (tests/test_records.py).

A script without a JSON output of its own is recorded by running it through
``python -m expertrail.tools.records --capture docs/results/NAME.json -- COMMAND...``: the record
holds the command, the machine, the date and what the command printed (kind ``output``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

BLOCK = re.compile(r"(<!-- record: (\S+) (\S+) -->\n)(.*?)(<!-- end record -->)", re.S)


def machine() -> dict:
    """What a recorded run was measured on: the CPU model and core count, memory, torch, Python,
    and the GPU where CUDA sees one."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                     platform.processor() or platform.machine())
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    gpu = None
    try:
        import torch
        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        torch_version = None
    return {"cpu": model, "cores": os.cpu_count(), "memory_GiB": round(mem_kib / 2**20, 1), "torch": torch_version,
            "python": platform.python_version(), "os": platform.platform(), **({"gpu": gpu} if gpu else {})}


def code() -> dict | None:
    """The commit the run's code came from and the files under src/ that differed from it (a
    shared working tree may hold changes in flight); None outside a git checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                                 text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "src_changed": [line[3:] for line in changed]}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def capture(path: Path, command: list[str]) -> int:
    """Run ``command``, print what it prints, and on success write the record of kind ``output``."""
    out = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    if out.returncode == 0:
        record = {"command": " ".join(shlex.quote(a) for a in command), "machine": machine(), "date": now(),
                  "code": code(), "output": out.stdout}
        path.write_text(json.dumps(record, indent=1) + "\n")
    return out.returncode


def _output(record: dict) -> str:
    """What a captured command printed, as it printed it."""
    return _fenced(record["output"])


def _fenced(text: str) -> str:
    return f"```\n{text.rstrip()}\n```\n"


def _bench(record: dict) -> str:
    """`expertrail bench`'s table, as it prints it."""
    from .bench import format_table
    return _fenced(format_table(record))


def _overlap(record: dict) -> str:
    """`expertrail bench --chunks`'s overlap table (one piece against chunks), as it prints it."""
    from .bench import format_overlap
    return _fenced(format_overlap(record))


def _decode(record: dict) -> str:
    """`expertrail bench --decode`'s table, as it prints it."""
    from .bench_decode import format_decode
    results = {mode: {int(tokens): r for tokens, r in sizes.items()} for mode, sizes in record["results"].items()}
    return _fenced(format_decode(dict(record, results=results)))       # JSON keys are strings


def _train(record: dict) -> str:
    """`expertrail train`'s summary lines (per backend: the largest difference from the
    single-process run, the first and last loss)."""
    lines = []
    for name, r in record["backends"].items():
        lines.append(f"{name}: max |loss - single process| = {r['max_abs_diff']:.2e}, loss {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f}")
    return _fenced("\n".join(lines))


def _train_overlap(record: dict) -> str:
    """`expertrail train --overlap`'s lines per backend: the step without and with overlap, the
    losses' agreement, and the CPU floor's ceiling."""
    from .commands.train import overlap_lines
    return _fenced("\n".join(line for name, r in record["backends"].items() for line in overlap_lines(name, r)))


def _cluster(record: dict) -> str:
    """`expertrail bench --nodes`'s figures against alltoall and the planner's prediction, as a
    Markdown table (ms per dispatch + combine, medians)."""
    rows = record["results"]
    base = rows["alltoall"]["total_s"]["median"]
    lines = ["| backend | measured | bare collectives | inter-node MB | vs alltoall | planner predicted | "
             "predicted / measured | planner bytes = engine bytes |", "|---|---|---|---|---|---|---|---|"]
    for name in [b for b in ("alltoall", "dedup", "hierarchical", "allgather") if b in rows]:
        r = rows[name]
        total, predicted = r["total_s"]["median"], r["predicted_total_s"]
        versus = "1.00x" if name == "alltoall" else \
            f"{base / total:.2f}x faster" if total <= base else f"{total / base:.2f}x slower"
        lines.append(f"| {name} | {total * 1e3:.1f} | {r['bare_total_s']['median'] * 1e3:.1f} | "
                     f"{r['dispatch_bytes']['inter'] / 1e6:.1f} | {versus} | {predicted * 1e3:.1f} | "
                     f"{predicted / total:.2f} | {'yes' if r['planner_bytes_match'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _serve_sim(record: dict) -> str:
    """`expertrail serve-sim`'s balancedness and step times, as two Markdown tables."""
    summary = record["summary"]
    balance, p50 = summary["balancedness_mean"], summary["step_p50_s"]
    lines = ["| layer | time-averaged balancedness | p50 step |", "|---|---|---|",
             f"| static (unreplicated, contiguous) | {balance['static']:.3f} | {p50['static'] * 1e3:.1f} ms |",
             f"| rebalanced | **{balance['rebalanced']:.3f}** | {p50['rebalanced'] * 1e3:.1f} ms |", "",
             "| step of the rebalancing layer | p50 | max |", "|---|---|---|"]
    names = {"normal": "normal", "migrate": "migrate (plan + transfers posted)",
             "switch": "switch (wait for the transfers)", "reweight": "re-weight (plan, nothing moves)"}
    for kind, name in names.items():
        lines.append(f"| {name} | {summary['rebalanced_step_p50_s'][kind] * 1e3:.1f} ms | "
                     f"{summary['rebalanced_step_max_s'][kind] * 1e3:.1f} ms |")
    return "\n".join(lines) + "\n"


def _calibration(record: dict) -> str:
    """The published training runs against `expertrail estimate` (plan.calibration; the
    record is its data file, the predictions are made now)."""
    from ..plan.calibration import table
    return table()


def user_process_table(record: dict) -> str:
    """`benchmarks/user_process.py`'s table: the mean ms per call of the slowest rank, and its
    ratio to the bare collectives and to the floor."""
    a, summary = record["args"], record["summary"]
    lines = [f"{record['world']} ranks, {a['tokens']} tokens/rank, hidden {a['hidden']}, {a['experts']} experts, "
             f"top-{a['topk']}, {a['dtype']}, default allocator, mean of {a['iters']} calls (slowest rank)",
             "| call | ms | x bare | x floor |", "|---|---|---|---|"]
    for name, t in summary["mean_s"].items():
        lines.append(f"| {name} | {1e3 * t:.1f} | {summary['ratio_to_bare'][name]:.2f} | "
                     f"{summary['ratio_to_floor'][name]:.2f} |")
    return "\n".join(lines) + "\n"


def user_process_soak_table(record: dict) -> str:
    """`benchmarks/user_process.py --soak`'s table: per rank, the pool's last growth and the
    resident memory then and at fractions of the calls."""
    a, per_rank = record["args"], record["per_rank"]
    marks = list(per_rank[0]["rss_at"])
    lines = [f"{a['soak']} calls of {a['backends'][0]}, {a['dtype']}, {a['tokens'] // 2 + 1}-{a['tokens']} "
             "tokens/rank changing every call",
             "| rank | pool's last growth (call) | pool MB | RSS then (MB) | RSS at " + " / ".join(marks)
             + " of the calls (MB) | growth since the pool's last growth |", "|---|---|---|---|---|---|"]
    for r, res in enumerate(per_rank):
        lines.append(f"| {r} | {res['high_water_call']} | {res['pool_MB']:.0f} | {res['rss_at_high_water'] / 2**20:.0f} | "
                     + " / ".join(f"{v / 2**20:.0f}" for v in res["rss_at"].values())
                     + f" | {100 * res['growth_after_high_water']:+.2f}% |")
    return "\n".join(lines) + "\n"


def _user_process(record: dict) -> str:
    return _fenced(user_process_table(record))


def _user_process_soak(record: dict) -> str:
    return _fenced(user_process_soak_table(record))


def against_megatron_table(record: dict) -> str:
    """`benchmarks/against_megatron.py`'s table: Megatron-Core's alltoall dispatcher and
    expertrail's `alltoall`, ms per dispatch -> scale -> combine, beside the bare collectives
    timed with expertrail's run."""
    a = next(iter(record["expertrail"].values()))["args"]
    lines = [f"{record['peer']['versions']}; 4 ranks, {a['tokens']} tokens/rank, hidden {a['hidden']}, "
             f"{a['experts']} experts, top-{a['topk']}; mean of {record['iters']} calls",
             "| | Megatron-Core alltoall | expertrail alltoall | bare collectives | Megatron-Core / expertrail |",
             "|---|---|---|---|---|"]
    for dtype, ours in record["expertrail"].items():
        mean = ours["summary"]["mean_s"]
        bare, er, mc = 1e3 * mean["bare"], 1e3 * mean["alltoall"], record["peer"]["ms"]["alltoall"][dtype]
        lines.append(f"| {dtype} | {mc:.1f} ms ({mc / bare:.2f}x bare) | {er:.1f} ms ({er / bare:.2f}x bare) | "
                     f"{bare:.1f} ms | {mc / er:.2f}x |")
    return "\n".join(lines) + "\n"


def _against_megatron(record: dict) -> str:
    return _fenced(against_megatron_table(record))


def _serve_bench(record: dict) -> str:
    """`expertrail serve-bench`'s summary, as it prints it."""
    from .serve_bench import summary_lines
    return _fenced("\n".join(summary_lines(record)))


def _hf_load(record: dict) -> str:
    """benchmarks/hf_load_memory.py's figures as docs/hf.md's table: peak RSS above the imports
    per process, its ratio to the whole-model load, and the load time (median, range)."""
    s, runs = record["summary"], record["runs"]
    mib = 2 ** 20

    def spread(times: list) -> str:
        return f"{min(times):.1f}-{max(times):.1f}"
    whole = [r["load_s"] for r in runs["whole"]]
    ep = [r["load_s"] for r in runs["ep"]]
    rows = ["| | peak RSS per process | ratio to the whole load | load time |", "|---|---|---|---|",
            f"| transformers `from_pretrained`, the whole model, 1 process | {s['whole_load_peak_mib']:,.0f} MiB | 1.00x | "
            f"{s['whole_load_s']:.2f} s ({spread(whole)}) |",
            f"| `er.hf.from_pretrained`, EP {record['ranks']}, {record['ranks']} ranks, while loading | "
            f"{s['ep_load_peak_mib']:,.0f} MiB | {s['load_ratio']:.2f}x | {s['ep_load_s']:.2f} s ({spread(ep)}) |",
            f"| `er.hf.save_pretrained`, EP {record['ranks']}, {record['ranks']} ranks, while saving | "
            f"{s['ep_save_peak_mib']:,.0f} MiB | {s['save_ratio']:.2f}x | |"]
    held = max(r["held_after_load"] for run in runs["ep"] for r in run["ranks"]) / mib
    return "\n".join(rows) + f"\n\nEach rank holds at most {held:.0f} MiB after loading.\n"


def _pipeline(record: dict, traces: bool = True) -> str:
    """benchmarks/pipeline_trace.py's report: time per call beside alltoall, and (``traces``)
    one traced call of each setting."""
    cfg, runs = record["config"], record["runs"]
    lines = [f"hierarchical, {cfg['world']} ranks, domain {cfg['domain_size']}, {cfg['tokens']} tokens, hidden "
             f"{cfg['hidden']}, {cfg['experts']} experts, top-{cfg['topk']}, bf16; dispatch + combine, median of "
             f"{cfg['iters']}",
             f"alltoall: {1e3 * runs['alltoall']['median_s']:.1f} ms per call"]
    for c in cfg["chunks"]:
        run = runs[str(c)]
        line = (f"pipeline_chunks={c}: {1e3 * run['median_s']:.1f} ms per call ({run['vs_alltoall']:.2f}x faster "
                "than alltoall)")
        if not traces:
            lines.append(line)
            continue
        lines += ["", f"{line}; one call on rank 0:"]
        lines += [f"  {ms:8.2f} ms  {what}" for ms, what in run["trace_ms"]]
    return _fenced("\n".join(lines))


def _pipeline_summary(record: dict) -> str:
    """benchmarks/pipeline_trace.py's report without the traced calls: time per call."""
    return _pipeline(record, traces=False)


KINDS = {"hf-load": _hf_load, "pipeline": _pipeline, "pipeline-summary": _pipeline_summary,
         "train-overlap": _train_overlap, "calibration": _calibration, "bench": _bench, "overlap": _overlap,
         "decode": _decode, "train": _train, "cluster": _cluster, "serve-sim": _serve_sim,
         "user-process": _user_process, "user-process-soak": _user_process_soak,
         "against-megatron": _against_megatron, "output": _output, "serve-bench": _serve_bench}


def render(kind: str, record: "Path | dict") -> str:
    """The block of ``kind`` for ``record`` (a record file, or the record itself)."""
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind](record if isinstance(record, dict) else json.loads(Path(record).read_text()))


def blocks(document: Path, docs: Path) -> list[tuple[str, str, str, str]]:
    """(record, kind, shown, rendered) of every block of ``document``; records are relative to
    ``docs``."""
    text = document.read_text()
    return [(record, kind, shown, render(kind, docs / record)) for _, record, kind, shown, _ in BLOCK.findall(text)]


def rewrite(document: Path, docs: Path) -> bool:
    """Write ``document``'s blocks anew from their records; whether anything changed."""
    text = document.read_text()
    new = BLOCK.sub(lambda m: m.group(1) + render(m.group(3), docs / m.group(2)) + m.group(5), text)
    if new != text:
        document.write_text(new)
    return new != text


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expertrail.tools.records", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: here)")
    parser.add_argument("--write", action="store_true", help="write the blocks anew from their records")
    parser.add_argument("--capture", type=Path, metavar="JSON",
                        help="run the command given after -- and record what it prints in JSON (kind output)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="with --capture: -- COMMAND...")
    args = parser.parse_args(argv)
    if args.capture:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("--capture needs a command after --")
        return capture(args.capture, command)
    docs, stale = args.root / "docs", []
    for document in documents(args.root):
        if args.write:
            if rewrite(document, docs):
                print(f"wrote {document}")
            continue
        stale += [f"{document}: {record} ({kind})" for record, kind, shown, rendered in blocks(document, docs)
                  if shown != rendered]
    for line in stale:
        print(f"differs from its record: {line}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
