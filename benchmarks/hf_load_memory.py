"""Peak host memory per rank of expertrail.hf.from_pretrained / save_pretrained against one
process loading the whole model with transformers.

Builds (once, in a scratch directory) a random Qwen3-MoE checkpoint whose expert weights are
most of its bytes (64 experts, fp32, written by transformers in several shards), then measures
in fresh processes:

- ``whole``: one process, ``AutoModelForCausalLM.from_pretrained(dir)``;
- ``ep``: 4 local gloo ranks, ``expertrail.hf.from_pretrained(dir, groups)`` at EP 4, then
  ``expertrail.hf.save_pretrained(model, out)``.

Each process reports its peak resident set (VmHWM of /proc/self/status, reset by writing 5 to
/proc/self/clear_refs) above what it holds after its imports (torch, transformers and the model's modules,
expertrail, process groups), while loading and while saving, and the load time. Both sides run ``--repeats``
times, alternating; the figures are the medians.

    .venv/bin/python benchmarks/hf_load_memory.py [--experts 64] [--layers 8] [--repeats 3] [--json PATH]

``--json PATH`` writes the record docs/results/hf-load.json keeps (command, machine, date,
model, every run and the summary printed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RANKS = 4


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns that RSS (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _imports() -> None:
    """What either side imports while loading, imported before the peak is reset (it counts as
    imports, not as loading): the model's modules and transformers' loading machinery."""
    import safetensors.torch  # noqa: F401
    import transformers.conversion_mapping  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def build_checkpoint(path: str, experts: int, layers: int) -> dict:
    """A random Qwen3-MoE saved by transformers (fp32, 100 MB shards): its sizes."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         num_experts=experts, num_experts_per_tok=4, mlp_only_layers=[], decoder_sparse_step=1,
                         tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="100MB")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    shards = sum(f.endswith(".safetensors") for f in os.listdir(path))
    return {"bytes": total, "expert_bytes": expert, "expert_share": expert / total, "shards": shards,
            "experts": experts, "layers": layers, "dtype": "float32"}


def whole(path: str, out: str) -> None:
    """One process: transformers' own from_pretrained of the whole model."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM
    _imports()
    base = _reset_peak()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - base
    json.dump({"load_peak": peak, "load_s": seconds, "params": sum(p.numel() for p in model.parameters())},
              open(out, "w"))


def _rank(rank: int, path: str, save_to: str, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import expertrail as er
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    groups = er.EPGroups.from_default()
    _imports()
    dist.barrier()
    base = _reset_peak()
    start = time.perf_counter()
    model = er.hf.from_pretrained(path, groups)
    dist.barrier()
    seconds = time.perf_counter() - start
    load_peak = _status("VmHWM") - base
    held = _status("VmRSS") - base
    base_save = _reset_peak()
    er.hf.save_pretrained(model, save_to, max_shard_size="100MB")
    save_peak = _status("VmHWM") - base_save
    # memory above the imports while saving: what the model holds plus the save's own
    json.dump({"rank": rank, "load_peak": load_peak, "load_s": seconds, "held_after_load": held,
               "save_peak": save_peak + held}, open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()


def ep(path: str, save_to: str, out: str) -> None:
    import torch.multiprocessing as mp
    import socket as s
    with s.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(path, save_to, out, port), nprocs=RANKS)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(RANKS)]
    json.dump({"ranks": ranks, "load_peak": max(r["load_peak"] for r in ranks),
               "save_peak": max(r["save_peak"] for r in ranks), "load_s": max(r["load_s"] for r in ranks)},
              open(out, "w"))


def _run(mode: str, *args: str) -> dict:
    """``mode`` in a fresh interpreter (peaks and imports of its own); its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, __file__, "--child", mode, *args, out], check=True)
    try:
        return json.load(open(out))
    finally:
        for p in [out] + [f"{out}.{r}" for r in range(RANKS)]:
            if os.path.exists(p):
                os.unlink(p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, *rest = args.child
        {"whole": whole, "ep": ep}[mode](*rest)
        return 0
    scratch = tempfile.mkdtemp(prefix="hf-load-")
    try:
        ckpt = os.path.join(scratch, "ckpt")
        model = build_checkpoint(ckpt, args.experts, args.layers)
        mib = 2 ** 20
        print(f"model: {model['bytes'] / mib:.0f} MiB fp32 in {model['shards']} shards, experts "
              f"{model['expert_share']:.1%} of it", flush=True)
        runs = {"whole": [], "ep": []}
        for i in range(args.repeats):
            runs["whole"].append(_run("whole", ckpt))
            saved = os.path.join(scratch, f"saved{i}")
            runs["ep"].append(_run("ep", ckpt, saved))
            shutil.rmtree(saved, ignore_errors=True)
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("load_peak", "load_s")} for side, rs in runs.items()}
        med["ep"]["save_peak"] = statistics.median(r["save_peak"] for r in runs["ep"])
        summary = {
            "whole_load_peak_mib": med["whole"]["load_peak"] / mib, "whole_load_s": med["whole"]["load_s"],
            "ep_load_peak_mib": med["ep"]["load_peak"] / mib, "ep_save_peak_mib": med["ep"]["save_peak"] / mib,
            "ep_load_s": med["ep"]["load_s"],
            "load_ratio": med["ep"]["load_peak"] / med["whole"]["load_peak"],
            "save_ratio": med["ep"]["save_peak"] / med["whole"]["load_peak"],
        }
        print(f"whole model, 1 process : load peak {summary['whole_load_peak_mib']:.0f} MiB, "
              f"{summary['whole_load_s']:.2f} s")
        print(f"expertrail EP {RANKS}, per rank: load peak {summary['ep_load_peak_mib']:.0f} MiB "
              f"({summary['load_ratio']:.2f}x), save peak {summary['ep_save_peak_mib']:.0f} MiB "
              f"({summary['save_ratio']:.2f}x), load {summary['ep_load_s']:.2f} s")
        if args.json:
            import torch
            import transformers
            record = {"command": "python " + shlex.join(["benchmarks/hf_load_memory.py", *(argv or sys.argv[1:])]),
                      "machine": {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
                                  "torch": torch.__version__, "transformers": transformers.__version__},
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "model": model, "ranks": RANKS, "runs": runs, "summary": summary}
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
