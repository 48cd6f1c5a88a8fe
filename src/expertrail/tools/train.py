"""`expertrail train`: a tiny MoE language model trained with expert parallelism on local ranks.

The model: token embedding, ``layers`` x (RMSNorm -> causal self-attention -> RMSNorm -> MoE
with a shared expert), RMSNorm, LM head. Data: sequences of a fixed random Markov rule (a
random start token, then ``next = rule[prev]``), made on the fly from the step and rank, so
the loss can fall. Every rank is a data-parallel replica of the dense weights and holds
``E / world`` experts; dense gradients are averaged over ranks, expert gradients arrive
summed through combine's backward and are scaled to the global mean.

The same model and data run on one process without any dispatcher (all experts local,
tokens grouped by expert directly) as the reference: per-step losses must agree.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .configs import TrainConfig
from ..dispatch import make_dispatcher
from ..moe.experts import GroupedExperts, SwiGLUMLP, delayable_linear
from ..moe.layer import MoELayer, router_loss
from ..moe.router import RouterConfig, TopKRouter
from ..comm.schedule import TaskLocal, Timeline, train_micro_batches
from ..comm.topology import EPGroups


class Attention(nn.Module):
    """Causal self-attention. Its projections' weight gradients are delayable
    (`experts.delayable_linear`): in an overlapped schedule they fill the next exchange's flight
    instead of the backward's critical path (the split of backward into input and weight parts
    that DualPipe makes for attention as for the MLP)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):                 # [B, S, H]
        b, s, h = x.shape
        q, k, v = delayable_linear(x, self.qkv.weight).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return delayable_linear(y.transpose(1, 2).reshape(b, s, h), self.out.weight)


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, moe: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.moe = moe

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, cfg: TrainConfig, moe_factory):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg, moe_factory(i)) for i in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens):            # [B, S] -> logits [B, S, V]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LocalMoE(nn.Module):
    """The reference MoE: router, all experts on this process, tokens grouped by expert with
    a sort (no dispatcher), shared expert added."""

    router_losses = TaskLocal()

    def __init__(self, router: TopKRouter, experts: GroupedExperts, shared: nn.Module):
        super().__init__()
        self.router, self.experts, self.shared_experts = router, experts, shared

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = self.router(x)
        self.router_losses = r.losses
        k = r.topk_idx.shape[1]
        order = torch.sort(r.topk_idx.reshape(-1), stable=True).indices
        counts = torch.bincount(r.topk_idx.reshape(-1), minlength=self.experts.num_local_experts)
        out = self.experts(flat.repeat_interleave(k, dim=0)[order], counts)
        per_slot = torch.empty_like(out).index_copy(0, order, out).view(-1, k, shape[-1])
        y = (per_slot * r.topk_weights.unsqueeze(-1).to(out.dtype)).sum(1)
        return (y + self.shared_experts(flat)).view(shape)


def build_full_model(cfg: TrainConfig) -> tuple[TinyMoELM, list]:
    """The reference model with every expert local; returns it and its expert modules."""
    torch.manual_seed(cfg.seed)
    experts = []

    def moe(i):
        router = TopKRouter(RouterConfig(hidden=cfg.hidden, num_experts=cfg.experts, topk=cfg.topk,
                                         aux_loss_coeff=cfg.aux_loss_coeff))
        grouped = GroupedExperts(cfg.experts, cfg.hidden, cfg.ffn)
        experts.append(grouped)
        return LocalMoE(router, grouped, SwiGLUMLP(cfg.hidden, cfg.ffn))
    return TinyMoELM(cfg, moe), experts


def build_ep_model(cfg: TrainConfig, groups: EPGroups, backend: str) -> TinyMoELM:
    """The same model (same initial weights) with each MoE expert-parallel over ``groups``."""
    full, _ = build_full_model(cfg)
    local = cfg.experts // groups.ep_size
    first = groups.ep_rank * local

    def moe(i):
        ref = full.blocks[i].moe
        experts = GroupedExperts(local, cfg.hidden, cfg.ffn)
        with torch.no_grad():
            experts.gate_up_proj.copy_(ref.experts.gate_up_proj[first:first + local])
            experts.down_proj.copy_(ref.experts.down_proj[first:first + local])
        d = make_dispatcher(backend, groups, num_experts=cfg.experts, hidden=cfg.hidden)
        # The reference's balance loss sees the whole global batch: here that is the global
        # variant, with expert loads summed over the ranks.
        ref.router.config = replace(ref.router.config, aux_loss_coeff=0.0, global_aux_loss_coeff=cfg.aux_loss_coeff)
        ref.router.load_group = groups.ep_group
        layer = MoELayer(ref.router, d, experts, ref.shared_experts)
        return layer
    model = TinyMoELM(cfg, moe)
    dense = {k: v for k, v in full.state_dict().items() if ".moe.experts." not in k}
    model.load_state_dict(dense, strict=False)
    return model


def make_batch(cfg: TrainConfig, step: int, rank: int, micro_batch: int = 0) -> torch.Tensor:
    """[batch, seq + 1] tokens following a fixed random rule from a random start."""
    rule = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(cfg.seed + 12345))
    g = torch.Generator().manual_seed(cfg.seed * 7919 + (step * cfg.micro_batches + micro_batch) * 104729 + rank)
    seq = [torch.randint(0, cfg.vocab, (cfg.batch,), generator=g)]
    for _ in range(cfg.seq):
        seq.append(rule[seq[-1]])
    return torch.stack(seq, 1)


def lm_loss(model: TinyMoELM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_reference(cfg: TrainConfig, world: int) -> list:
    """Per-step losses of the single-process run on the global batch (all ranks' data), with
    the same micro-batches."""
    model, _ = build_full_model(cfg)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        total = 0.0
        for m in range(cfg.micro_batches):
            batch = torch.cat([make_batch(cfg, step, r, m) for r in range(world)])
            loss = lm_loss(model, batch)
            ((loss + router_loss(model)) / cfg.micro_batches).backward()
            total += loss.item() / cfg.micro_batches
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_rank(rank: int, world: int, cfg: TrainConfig, backend: str, domain_size: int | None = None) -> dict:
    """Expert-parallel training on this rank. Returns, per mode run, the global mean loss, the
    wall time of every step and its CPU floor (`cpu_floors`): ``{"sequential": {"losses":
    [...], "step_times": [...], "cpu_floors": [...]}}``, plus ``"overlap"`` with
    ``cfg.overlap``: the same model trained on the same micro-batches with the 1F1B overlapped
    schedule, step by step beside the sequential one (alternating, so the machine's noise falls
    on both alike)."""
    groups = EPGroups.from_default(domain_size=domain_size or max(1, world // 2))
    modes = ["sequential", "overlap"] if cfg.overlap else ["sequential"]
    runs = {}
    for mode in modes:
        model = build_ep_model(cfg, groups, backend)
        model.train()
        runs[mode] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=cfg.lr), "losses": [],
                      "step_times": [], "cpu_times": []}
    for step in range(cfg.steps):
        for mode in modes:
            run = runs[mode]
            try:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                loss = _train_step(run["model"], run["opt"], cfg, step, rank, world, mode == "overlap")
                run["step_times"].append(time.perf_counter() - start)
                run["cpu_times"].append(time.process_time() - cpu)
                run["losses"].append(loss)
            except Exception as err:        # say which step: the CLI reports it with the backend
                raise RuntimeError(f"{backend} training ({mode}), step {step}: {type(err).__name__}: {err}") from err
    return {mode: {"losses": runs[mode]["losses"], "step_times": runs[mode]["step_times"],
                   "cpu_floors": cpu_floors(runs[mode]["cpu_times"])} for mode in modes}


def cpu_floors(cpu_times: list) -> list:
    """Per step, the least wall time the CPUs allow (`floor_per_step`) from this rank's
    ``cpu_times`` (every thread of the process) and every other rank's. Collective over the
    default group."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ((socket.gethostname(), tuple(cores)), len(cores), list(cpu_times)))
    return floor_per_step(everyone)


def floor_per_step(ranks: list) -> list:
    """``ranks``: (the cores it runs on, as (host, core ids), their number, CPU seconds per step)
    of every rank -> per step, the CPU time all ranks on one set of cores spent over those cores,
    the largest over the sets (an emulated node pins its ranks to its own cores). When ranks
    share cores no schedule, overlapped or not, makes a step shorter than this."""
    totals, cores_of = {}, {}
    for where, cores, times in ranks:
        totals[where] = [a + b for a, b in zip(totals.get(where, [0.0] * len(times)), times)]
        cores_of[where] = cores
    return [max(totals[where][i] / cores_of[where] for where in totals) for i in range(len(ranks[0][2]))]


def _train_step(model, opt, cfg: TrainConfig, step: int, rank: int, world: int, overlap: bool) -> float:
    """One SGD step of the expert-parallel model over ``cfg.micro_batches`` micro-batches;
    returns the global mean loss."""
    is_expert = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    lm_losses = {}

    def forward(m):
        # The global loss is the mean of the ranks' losses: scale by 1/world here, then sum
        # dense gradients over ranks (experts already receive every rank's contribution).
        lm_losses[m] = loss = lm_loss(model, make_batch(cfg, step, rank, m))
        return (loss + router_loss(model)) / (world * cfg.micro_batches)
    summing = []

    def dense_grads_ready():      # travels while the experts' last delayed weight gradients run
        summing.append(sum_over_ranks([p.grad for p in model.parameters()
                                       if id(p) not in is_expert and p.grad is not None], async_op=True))
    train_micro_batches(forward, list(range(cfg.micro_batches)), overlap=overlap,
                        ready_first=lambda p: id(p) not in is_expert, on_ready=dense_grads_ready)
    summing[0]()
    opt.step()
    opt.zero_grad()
    mean = sum(lm_losses[m].detach() for m in range(cfg.micro_batches)).reshape(1) / (world * cfg.micro_batches)
    dist.all_reduce(mean)
    return mean.item()


def sum_over_ranks(tensors: list, async_op: bool = False):
    """All-reduce (sum) ``tensors`` in place over the default group: one flat all-reduce per
    dtype, not one per tensor (each would pay the inter-node round trip). With ``async_op`` the
    all-reduces are left in flight and a function is returned that waits for them and writes
    the sums back."""
    pending = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        pending.append((group, flat, dist.all_reduce(flat, async_op=True)))

    def finish():
        for group, flat, work in pending:
            work.wait()
            for t, summed in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(summed.view_as(t))
    if async_op:
        return finish
    finish()


def _median_step(times: list) -> float:
    """The median step time, the first step (warm-up: buffers grow) left out when there are more."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def summarize(cfg: TrainConfig, reference: list, runs: dict) -> dict:
    """Per backend (``runs[b]`` as `train_rank` returns it): the losses and median step time
    of the run (the overlapped one with ``cfg.overlap``), max |loss - reference| over steps, the
    first step beyond ``cfg.tolerance`` (None if none) and whether the loss fell; with
    ``cfg.overlap`` also the run without overlap, the speed-up and whether the losses are
    identical."""
    out = {"config": asdict(cfg), "reference": reference, "backends": {}}
    for name, modes in runs.items():
        run = modes["overlap" if cfg.overlap else "sequential"]
        losses = run["losses"]
        diffs = [abs(a - b) for a, b in zip(losses, reference)]
        bad = [step for step, d in enumerate(diffs) if not (d <= cfg.tolerance)]    # NaN counts as bad
        r = out["backends"][name] = {"losses": losses, "step_time_s": _median_step(run["step_times"]),
                                     "cpu_floor_s": _median_step(run["cpu_floors"]),
                                     "max_abs_diff": max(diffs), "first_bad_step": bad[0] if bad else None,
                                     "loss_fell": losses[-1] < losses[0] - 0.1 * abs(losses[0]),
                                     "matches_reference": not bad}
        if cfg.overlap:
            without = modes["sequential"]
            r["without_overlap"] = {"losses": without["losses"], "step_time_s": _median_step(without["step_times"]),
                                  "cpu_floor_s": _median_step(without["cpu_floors"])}
            r["overlap_speedup"] = r["without_overlap"]["step_time_s"] / r["step_time_s"]
            # The most any schedule could gain here: the step without overlap over the CPU floor.
            r["overlap_ceiling"] = r["without_overlap"]["step_time_s"] / r["cpu_floor_s"] if r["cpu_floor_s"] else None
            r["same_losses"] = without["losses"] == losses
    return out


def timeline_spans(rank: int, world: int, cfg: TrainConfig, backend: str, domain_size: int | None = None) -> dict:
    """Rank-local spans (`schedule.Timeline`) of one training step without and one with
    overlap, after two warm-up steps of each; times from each step's start."""
    groups = EPGroups.from_default(domain_size=domain_size or max(1, world // 2))
    model = build_ep_model(cfg, groups, backend)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    spans = {}
    for step, overlap in enumerate((False, True, False, True, False, True)):
        dist.barrier()
        with Timeline() as t:
            start = time.perf_counter()
            _train_step(model, opt, cfg, step, rank, world, overlap)
        spans["overlap" if overlap else "sequential"] = [(lane, kind, what, a - start, b - start)
                                                         for lane, kind, what, a, b in t.spans]
    return spans


def write_timeline(spans: dict, path: str) -> None:
    """Draw `timeline_spans`' result: one panel per run, a row per micro-batch's forward or
    backward, solid bars where it held the cores, grey where it held them waiting for an
    exchange with nothing to run, hatched where it filled such a wait with delayed weight
    gradients, thin bars for its exchanges in flight."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    end = max(b for run in spans.values() for *_, b in run)
    # span kind -> (bar height, style), drawn in this order; a run takes its lane's colour
    styles = {"run": (0.7, {}), "blocked": (0.7, {"color": "lightgrey"}),
              "filler": (0.7, {"facecolor": "none", "edgecolor": "black", "hatch": "///", "linewidth": 0}),
              "exchange": (0.2, {"color": "tab:orange"})}
    fig, axes = plt.subplots(len(spans), 1, figsize=(11, 1.2 + 1.5 * len(spans)), sharex=True, squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], spans.items()):
        lanes = sorted({lane for lane, *_ in run}, key=lambda lane: (int(lane[1:]), lane[0] == "B"))
        for y, lane in enumerate(lanes):
            mine = [(kind, a, b) for ln, kind, _, a, b in run if ln == lane]
            for kind, (height, style) in styles.items():
                colour = {"color": "tab:blue" if lane[0] == "F" else "tab:green"} if kind == "run" else {}
                ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for k, a, b in mine if k == kind], (y - height / 2, height),
                               **style, **colour)
        ax.set_yticks(range(len(lanes)), lanes)
        step = max(b for *_, b in run)
        ax.set_title(f"{'with' if mode == 'overlap' else 'without'} overlap: step {1e3 * step:.0f} ms (rank 0)")
        ax.set_xlim(0, 1e3 * end)
    axes[-1, 0].set_xlabel("ms")
    fig.legend(handles=[Patch(color="tab:blue", label="forward holding the cores"),
                        Patch(color="tab:green", label="backward holding the cores"),
                        Patch(facecolor="white", edgecolor="black", hatch="///", label="delayed weight gradients filling a wait"),
                        Patch(color="lightgrey", label="waiting, nothing to run"),
                        Patch(color="tab:orange", label="its exchange in flight")],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
