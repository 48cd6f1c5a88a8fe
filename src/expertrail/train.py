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

from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .configs import TrainConfig
from .dispatch import make_dispatcher
from .experts import GroupedExperts, SwiGLUMLP
from .layer import MoELayer, router_loss
from .router import RouterConfig, TopKRouter
from .topology import EPGroups


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):                 # [B, S, H]
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


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

    def __init__(self, router: TopKRouter, experts: GroupedExperts, shared: nn.Module):
        super().__init__()
        self.router, self.experts, self.shared_experts = router, experts, shared
        self.router_losses = {}

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


def make_batch(cfg: TrainConfig, step: int, rank: int) -> torch.Tensor:
    """[batch, seq + 1] tokens following a fixed random rule from a random start."""
    rule = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(cfg.seed + 12345))
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step * 104729 + rank)
    seq = [torch.randint(0, cfg.vocab, (cfg.batch,), generator=g)]
    for _ in range(cfg.seq):
        seq.append(rule[seq[-1]])
    return torch.stack(seq, 1)


def lm_loss(model: TinyMoELM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_reference(cfg: TrainConfig, world: int) -> list:
    """Per-step losses of the single-process run on the global batch (all ranks' data)."""
    model, _ = build_full_model(cfg)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        batch = torch.cat([make_batch(cfg, step, r) for r in range(world)])
        loss = lm_loss(model, batch)
        (loss + router_loss(model)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_rank(rank: int, world: int, cfg: TrainConfig, backend: str) -> list:
    """Expert-parallel training on this rank; returns the global mean loss of every step."""
    groups = EPGroups.from_default(domain_size=max(1, world // 2))
    model = build_ep_model(cfg, groups, backend)
    model.train()
    expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        try:
            losses.append(_train_step(model, opt, cfg, step, rank, world, expert_params))
        except Exception as err:        # say which step: the CLI reports it with the backend
            raise RuntimeError(f"{backend} training, step {step}: {type(err).__name__}: {err}") from err
    return losses


def _train_step(model, opt, cfg: TrainConfig, step: int, rank: int, world: int, expert_params: set) -> float:
    """One SGD step of the expert-parallel model; returns the global mean loss."""
    loss = lm_loss(model, make_batch(cfg, step, rank))
    # The global loss is the mean of the ranks' losses: scale by 1/world here, then sum
    # dense gradients over ranks (experts already receive every rank's contribution).
    ((loss + router_loss(model)) / world).backward()
    for p in model.parameters():
        if id(p) not in expert_params and p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    mean = loss.detach().reshape(1) / world
    dist.all_reduce(mean)
    return mean.item()


def summarize(cfg: TrainConfig, reference: list, runs: dict) -> dict:
    """Per backend: max |loss - reference| over steps, the first step beyond ``cfg.tolerance``
    (None if none), and whether the loss fell."""
    out = {"config": asdict(cfg), "reference": reference, "backends": {}}
    for name, losses in runs.items():
        diffs = [abs(a - b) for a, b in zip(losses, reference)]
        bad = [step for step, d in enumerate(diffs) if not (d <= cfg.tolerance)]    # NaN counts as bad
        diff = max(diffs)
        out["backends"][name] = {"losses": losses, "max_abs_diff": diff,
                                 "first_bad_step": bad[0] if bad else None,
                                 "loss_fell": losses[-1] < losses[0] - 0.1 * abs(losses[0]),
                                 "matches_reference": not bad}
    return out
