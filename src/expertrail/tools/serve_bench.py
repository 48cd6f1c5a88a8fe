"""Serving a Hugging Face MoE model expert parallel: bucketed dispatch and live rebalancing in
``generate``, against the same model without them, in one run (`expertrail serve-bench`).

Every rank builds the same model three times, patched over the EP group with the ``dedup``
normal mode (the one the low-latency mode reproduces bit for bit):

- ``normal``: every step through the normal mode, experts where patch_model puts them;
- ``buckets``: decode steps through the low-latency mode by token-count bucket (`bucketed`);
- ``rebalanced``: buckets, and experts on E + ``redundant`` slots that `LiveRebalancer`
  re-plans from a rolling window while ``generate`` runs.

Traffic: a stream of rounds; each round every rank generates greedily from ``batch`` prompts
(``batch`` tokens per rank per decode step) of one topic, the topic moving every
``topic_every`` rounds. A tiny random model's router does not follow topics (its logits are
near zero whatever the tokens), so the hot experts are moved by force, as serve-sim's
`DriftingZipf` moves them: each router's logits get ``skew * log p(e)`` added, p a Zipf(1)
popularity over a ranking of the experts drawn per topic (the same on every rank and in all
three models, so they compute one function). ``skew=0`` leaves the model as it is.

Measured per model forward (one per prefill or decode step; every rank runs the same forwards,
generate's ``synced_gpus`` keeping early finishers in): the slowest rank's seconds, the mode its
MoE blocks ran (``normal`` or a bucket), and rows per rank summed over the blocks, from which the
step's balancedness (mean / max rows per rank). Tokens are compared: buckets against normal
(bitwise equal outputs: must be equal) and rebalanced against buckets (equal up to fp32
rounding of the expert sums: equal unless two logits nearly tie).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import ConfigError

VARIANTS = ("normal", "buckets", "rebalanced")


@dataclass
class ServeBenchConfig:
    """Settings of `expertrail serve-bench`."""

    model: str = "tiny"            # "tiny" or a checkpoint directory
    ep: int = 4
    batch: int = 8                 # sequences per rank = tokens per rank per decode step
    prompt_len: int = 8
    new_tokens: int = 24
    rounds: int = 8
    topic_every: int = 2           # rounds per topic
    buckets: list = field(default_factory=lambda: [8, 32, 128])
    redundant: int = 4             # extra slots per block for replicas (a multiple of ep in total with E)
    rebalance_every: int = 2       # forwards between plans
    window: int = 4                # forwards in the load window
    min_gain: float = 0.02
    skew: float = 2.0              # forced routing drift: logits += skew * log p(e)
    layers: int = 4                # tiny model
    hidden: int = 64
    experts: int = 16
    topk: int = 4
    vocab: int = 256
    seed: int = 0

    def check(self) -> None:
        for name in ("ep", "batch", "prompt_len", "new_tokens", "rounds", "topic_every", "rebalance_every", "window",
                     "layers", "hidden", "experts", "topk", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.model == "tiny" and (self.experts % self.ep or (self.experts + self.redundant) % self.ep):
            raise ConfigError(f"--experts {self.experts} and experts + --redundant {self.redundant} must be multiples "
                              f"of --ep {self.ep}")
        if self.redundant < 1:
            raise ConfigError(f"--redundant {self.redundant}: give at least 1 slot for replicas")
        if self.skew < 0:
            raise ConfigError(f"--skew {self.skew}: give a number >= 0")


def tiny_model(cfg: ServeBenchConfig):
    """A tiny random Qwen3-MoE causal LM from a transformers config, the same on every rank."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(cfg.seed)
    config = Qwen3MoeConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
                            moe_intermediate_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=cfg.hidden // 4, num_experts=cfg.experts,
                            num_experts_per_tok=cfg.topk, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], max_position_embeddings=256, pad_token_id=0, eos_token_id=None)
    return Qwen3MoeForCausalLM(config).eval()


class TopicDrift:
    """The forced routing drift (module docstring): ``topic`` picks the ranking; a forward hook
    on each router adds ``skew * log p`` to its logits and redoes its softmax top-k."""

    def __init__(self, num_experts: int, skew: float, seed: int):
        from .serving import DriftingZipf
        self.zipf = DriftingZipf(num_experts, 1, 1.0, drift_every=1, seed=seed)
        self.skew, self.topic, self._bias = skew, 0, {}

    def bias(self):
        """float32 [E]: this topic's logit shift (made once per topic)."""
        if self.topic not in self._bias:
            self._bias[self.topic] = (self.skew * self.zipf.popularity(self.topic).log()).float()
        return self._bias[self.topic]

    def attach(self, gate) -> None:
        if not hasattr(gate, "top_k"):
            raise ConfigError(f"--skew needs a softmax top-k router with a top_k attribute (Qwen3-MoE, Mixtral), not "
                              f"{type(gate).__name__}: pass --skew 0 to serve the model's own routing")
        import torch

        def drifted(module, args, output):
            logits = output[0] + self.bias().to(output[0].dtype)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, idx = torch.topk(probs, module.top_k, dim=-1)
            if getattr(module, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        gate.register_forward_hook(drifted)


class StepMeter:
    """Per forward of ``model``: seconds, the blocks' mode, rows per rank summed over blocks."""

    def __init__(self, model, blocks, groups):
        import torch
        self.blocks, self.groups = blocks, groups
        self.seconds, self.modes, self.rows, self.tokens = [], [], [], []
        self._seen = []            # this forward's routing per block: topk ids [T, K], or rows per rank [P]
        self._per_rank = blocks[0].experts.num_local_experts
        for b in blocks:
            if b.replicas is None:
                b.gate.register_forward_hook(lambda m, a, out: self._seen.append(out[-1]))
            else:
                b.register_forward_hook(lambda m, a, out: self._seen.append(m.replicas.rows_per_rank.clone()))
        # First in and last out, so the time includes the other hooks (the bucket agreement is
        # posted, the rebalancer plans and switches, in hooks of the model's forward); the rows
        # are counted after the clock stops.
        model.register_forward_pre_hook(self._start, prepend=True)
        model.register_forward_hook(self._stop)

    def _start(self, module, args, kwargs=None):
        self._seen.clear()
        self._t = time.perf_counter()

    def _stop(self, module, args, output):
        import torch
        self.seconds.append(time.perf_counter() - self._t)
        b = self.blocks[0].bucketed
        self.modes.append("normal" if b is None else str(b.last))
        rows = torch.zeros(self.groups.ep_size, dtype=torch.int64)
        for seen in self._seen:
            if seen.dim() == 1:
                rows += seen
            else:
                ranks = seen[seen >= 0] // self._per_rank
                rows += torch.bincount(ranks, minlength=self.groups.ep_size)
        self.rows.append(rows)


def _prompts(cfg: ServeBenchConfig, round_: int, rank: int):
    """int64 [batch, prompt_len]: this rank's prompts of the round's topic (tokens from the
    topic's slice of the vocabulary)."""
    import torch
    topic = round_ // cfg.topic_every
    width = max(cfg.vocab // 8, 2)
    low = 1 + (topic % 8) * width
    g = torch.Generator().manual_seed((cfg.seed * 1009 + round_) * 131 + rank)
    return torch.randint(low, min(low + width, cfg.vocab), (cfg.batch, cfg.prompt_len), generator=g)


def _build(cfg: ServeBenchConfig, groups, base, variant: str):
    """The model of ``variant``, patched over ``groups``."""
    import torch
    from ..balance import ReplicaRouter, plan_placement
    from ..moe import hf
    options = {"backend": "dedup"}
    if variant != "normal":
        options["buckets"] = cfg.buckets
    experts = None
    if variant == "rebalanced":
        experts = base.config.num_experts if base is not None else _experts_of(cfg.model)
        placement = plan_placement(np.ones(experts), experts + cfg.redundant, groups.ep_size)
        options["replicas"] = ReplicaRouter.from_placement(placement)
    if base is not None:
        model = copy.deepcopy(base)
        hf.patch_model(model, groups, **options)
    else:
        model = hf.from_pretrained(cfg.model, groups, dtype=torch.float32, **options)
    return model.eval()


def _experts_of(path: str) -> int:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ConfigError(f"{path}: its config names no expert count")


def serve_bench_rank(rank: int, world: int, cfg: ServeBenchConfig) -> dict:
    """Run on every rank: the three models on the same rounds (their order rotating each
    round). Returns the report, the same on every rank."""
    import torch
    import torch.distributed as dist
    from ..comm.topology import EPGroups
    from ..moe.hf import _patched_blocks
    from ..moe.rebalancing import LiveRebalancer
    groups = EPGroups.from_default()
    base = tiny_model(cfg) if cfg.model == "tiny" else None
    models, meters, drifts = {}, {}, {}
    for v in VARIANTS:
        model = _build(cfg, groups, base, v)
        blocks = [b for _, b in _patched_blocks(model)]
        drift = TopicDrift(blocks[0].num_experts, cfg.skew, cfg.seed) if cfg.skew > 0 else None
        if drift is not None:
            for b in blocks:
                drift.attach(b.gate)          # before the rebalancer's hooks: it records the drifted choice
        if v == "rebalanced":
            rebalancer = LiveRebalancer(model, cfg.rebalance_every, cfg.window, min_gain=cfg.min_gain)
        models[v], drifts[v], meters[v] = model, drift, StepMeter(model, blocks, groups)
    tokens = {v: [] for v in VARIANTS}
    wall = {v: 0.0 for v in VARIANTS}
    kinds, rounds_of = [], []
    for r in range(cfg.rounds):
        prompts = _prompts(cfg, r, groups.ep_rank)
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for v in order:
            if drifts[v] is not None:
                drifts[v].topic = r // cfg.topic_every
            before = len(meters[v].seconds)
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                out = models[v].generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                         max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
                                         pad_token_id=0)
            wall[v] += time.perf_counter() - start
            tokens[v].append(out[:, cfg.prompt_len:])
            if v == "normal":
                steps = len(meters[v].seconds) - before
                kinds += ["prefill"] + ["decode"] * (steps - 1)
                rounds_of += [r] * steps
    steps = len(kinds)
    seconds = torch.tensor([meters[v].seconds for v in VARIANTS], dtype=torch.float64)          # [3, steps]
    rows = torch.stack([torch.stack(meters[v].rows) for v in VARIANTS])                         # [3, steps, P]
    same = torch.tensor([all(torch.equal(a, b) for a, b in zip(tokens["buckets"], tokens["normal"])),
                         all(torch.equal(a, b) for a, b in zip(tokens["rebalanced"], tokens["buckets"]))],
                        dtype=torch.int64)
    walls = torch.tensor([wall[v] for v in VARIANTS], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(rows)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    modes = {v: meters[v].modes for v in VARIANTS}
    for v in VARIANTS:               # every rank ran the same modes at the same steps
        groups.check_same({"modes": ",".join(modes[v])}, f"serve-bench {v} modes")
    generated = cfg.rounds * cfg.batch * cfg.new_tokens * groups.ep_size
    return report(cfg, kinds, rounds_of, seconds, rows, modes, bool(same[0]), bool(same[1]),
                  {v: generated / float(walls[i]) for i, v in enumerate(VARIANTS)},
                  rebalancer.events, rebalancer.migrations, steps)


def _quantile(values: list, q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def report(cfg, kinds, rounds_of, seconds, rows, modes, buckets_same, rebalanced_same, tokens_per_s, events,
           migrations, steps) -> dict:
    """The JSON of a run from its per-step figures (seconds [3, steps] of the slowest rank,
    rows [3, steps, P] summed over ranks and blocks)."""
    from ..balance.planner import balancedness
    sec = {v: seconds[i].tolist() for i, v in enumerate(VARIANTS)}
    bal = {v: balancedness(rows[i].double().numpy()).tolist() for i, v in enumerate(VARIANTS)}
    by_mode = {}
    for v in VARIANTS:
        groups_ = {}
        for s, kind, mode in zip(sec[v], kinds, modes[v]):
            groups_.setdefault(f"{kind}:{mode}", []).append(s)
        by_mode[v] = {k: {"steps": len(x), "p50_s": _quantile(x, 0.5), "p99_s": _quantile(x, 0.99)}
                      for k, x in sorted(groups_.items())}
    decode = {v: [s for s, k in zip(sec[v], kinds) if k == "decode"] for v in VARIANTS}
    small = cfg.batch <= 8
    return {
        "config": asdict(cfg),
        "decode_tokens_per_rank": cfg.batch,
        "decode_p50_s": {"buckets": _quantile(decode["buckets"], 0.5) if small else None,
                         "normal": _quantile(decode["normal"], 0.5) if small else None},
        "decode_p99_s": {"buckets": _quantile(decode["buckets"], 0.99), "normal": _quantile(decode["normal"], 0.99)},
        "decode_p50_by_model_s": {v: _quantile(decode[v], 0.5) for v in VARIANTS},
        "by_mode": by_mode,
        "tokens_per_s": tokens_per_s,
        "tokens_identical": bool(buckets_same and rebalanced_same),
        "tokens_identical_detail": {"buckets_vs_normal": buckets_same, "rebalanced_vs_static": rebalanced_same},
        "balancedness": {"rebalanced": float(np.mean(bal["rebalanced"])), "static": float(np.mean(bal["buckets"]))},
        "migrations": migrations,
        "events": [list(e) for e in events],
        "steps": {"kind": kinds, "round": rounds_of, "seconds": sec, "mode": modes,
                  "balancedness": {"static": bal["buckets"], "rebalanced": bal["rebalanced"]}},
    }


def summary_lines(result: dict) -> list[str]:
    """What `expertrail serve-bench` prints (and docs/benchmarks.md shows from its record)."""
    cfg = result["config"]
    lines = [f"serve-bench: {cfg['model']} model ({cfg['layers']} layers, {cfg['experts']} experts top-{cfg['topk']}, "
             f"hidden {cfg['hidden']})" if cfg["model"] == "tiny" else f"serve-bench: {cfg['model']}",
             f"  EP {cfg['ep']}, {cfg['rounds']} rounds x {cfg['batch']} prompts/rank of {cfg['prompt_len']} tokens, "
             f"{cfg['new_tokens']} new tokens each; topic moves every {cfg['topic_every']} rounds (skew {cfg['skew']})",
             f"  buckets {cfg['buckets']}; rebalanced: +{cfg['redundant']} slots/block, plan every "
             f"{cfg['rebalance_every']} forwards from a {cfg['window']}-forward window",
             *([f"  emulated cluster: {cfg['ep'] // em['ranks_per_node']} nodes x {em['ranks_per_node']} ranks, "
                f"{em['inter_link']} between nodes"] if (em := result.get("emulated")) else []),
             f"{'model':<12}{'step':<16}{'steps':>6}{'p50 ms':>9}{'p99 ms':>9}"]
    for v, groups_ in result["by_mode"].items():
        for k, g in groups_.items():
            lines.append(f"{v:<12}{k:<16}{g['steps']:>6}{1e3 * g['p50_s']:>9.2f}{1e3 * g['p99_s']:>9.2f}")
    d = result["decode_p50_s"]
    if d["buckets"] is not None:
        lines.append(f"decode p50 at {result['decode_tokens_per_rank']} tokens/rank: buckets {1e3 * d['buckets']:.2f} ms, "
                     f"normal {1e3 * d['normal']:.2f} ms ({d['buckets'] / d['normal']:.3f}x)")
    t = result["tokens_per_s"]
    lines.append("tokens/s: " + ", ".join(f"{v} {t[v]:.0f}" for v in VARIANTS))
    b = result["balancedness"]
    lines.append(f"balancedness (mean / max rows per rank, mean over steps): static {b['static']:.3f}, rebalanced "
                 f"{b['rebalanced']:.3f} ({result['migrations']} block migrations)")
    det = result["tokens_identical_detail"]
    lines.append(f"tokens identical: buckets vs normal {'yes' if det['buckets_vs_normal'] else 'NO'}, "
                 f"rebalanced vs static {'yes' if det['rebalanced_vs_static'] else 'NO'}")
    return lines


def plot(result: dict, path: str) -> None:
    """Balancedness and step latency over the run's steps, per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = result["steps"]
    x = np.arange(len(steps["kind"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for m, values in steps["balancedness"].items():
        top.plot(x, values, lw=1, label=f"{m} (mean {result['balancedness'][m]:.3f})")
    for v, values in steps["seconds"].items():
        bottom.plot(x, 1e3 * np.asarray(values), lw=0.8, label=v)
    top.set_ylabel("balancedness")
    top.set_ylim(0, 1.05)
    top.legend(fontsize=8, loc="lower right")
    bottom.set_ylabel("forward ms (slowest rank)")
    bottom.set_yscale("log")
    bottom.set_xlabel("model forward (prefill and decode steps)")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

