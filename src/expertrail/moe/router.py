"""TopKRouter: token -> top-k experts, with the routing features of production MoE models.

All router math runs in fp32 whatever the input dtype. Features (each off by default unless
noted): softmax or sigmoid scores; softmax before top-k (over all experts) or after it (over
the K chosen logits); renormalising the K weights; a scaling factor; group-limited routing
(DeepSeek-V3: a group's score is the sum of its two best expert scores, only the best
``group_topk`` groups are eligible); an expert bias used only for selection, updated without
an auxiliary loss (bias += rate * sign(mean load - load)); the Switch auxiliary loss, its
per-sequence and global-batch variants; the z-loss; input jitter; forced load balancing.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError, InvalidInputError
from ..kernels.torch_ops import count_values
from ..comm.schedule import wait_exchange
from ..comm.transport import Transfer


@dataclass
class RouterConfig:
    """Settings of a `TopKRouter` (names follow Megatron-Core's ``moe_router_*`` options).

    score_function: "softmax" or "sigmoid".
    pre_softmax: softmax over all experts, then top-k (else top-k on logits, then softmax over
        the K chosen). Ignored for sigmoid.
    normalize_topk: divide the K weights by their sum (sigmoid routers usually do).
    scaling_factor: multiply the final weights by this.
    num_groups / group_topk: group-limited routing (experts split into ``num_groups`` equal
        groups; only the ``group_topk`` best groups are eligible).
    expert_bias / bias_update_rate: aux-loss-free balancing (bias only affects selection).
    aux_loss_coeff / seq_aux_loss_coeff / global_aux_loss_coeff / z_loss_coeff: loss weights.
    input_jitter: multiply inputs by U(1 - eps, 1 + eps) in training.
    force_balance: ignore the scores for selection and give every expert the same number of
        rows (deterministic, identical on every rank): for benchmarks.
    """

    hidden: int
    num_experts: int
    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    normalize_topk: bool = False
    scaling_factor: float = 1.0
    num_groups: int | None = None
    group_topk: int | None = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    input_jitter: float = 0.0
    force_balance: bool = False

    def __post_init__(self):
        if self.score_function not in ("softmax", "sigmoid"):
            raise ConfigError(f"score_function={self.score_function!r}; choose 'softmax' or 'sigmoid'")
        if not 0 < self.topk <= self.num_experts:
            raise ConfigError(f"topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ConfigError("num_groups and group_topk go together: set both for group-limited routing, or neither")
        if self.num_groups is not None:
            if self.num_experts % self.num_groups:
                raise ConfigError(f"num_groups={self.num_groups} must divide num_experts={self.num_experts}")
            per_group = self.num_experts // self.num_groups
            if not 0 < self.group_topk <= self.num_groups or self.group_topk * per_group < self.topk:
                raise ConfigError(f"group_topk={self.group_topk} groups of {per_group} experts cannot hold topk="
                                  f"{self.topk} experts (need 0 < group_topk <= num_groups={self.num_groups})")
            if per_group < 2:
                raise ConfigError("group-limited routing scores a group by its two best experts: "
                                  f"groups of {per_group} expert are too small")


class RouterLosses(Mapping):
    """A router call's losses, name -> scalar (already multiplied by their coefficient).

    A loss that waits for an exchange (the global-batch loss's expert loads, summed over the
    ranks) is computed on first read, not in the router: the loads travel while the rest of the
    forward runs, instead of holding the cores while they queue behind a dispatch's rows on the
    link (`schedule`). Reading any entry, or iterating, computes every pending one, under the
    gradient mode of the router's call (a loss first read inside ``torch.no_grad()`` still
    has its gradient); the values are the same tensors either way."""

    def __init__(self):
        self._values: dict = {}
        self._pending: dict = {}

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._values[name] = value

    def add_pending(self, name: str, compute: Callable[[], torch.Tensor]) -> None:
        """Register ``name``, computed by ``compute()`` when first read."""
        self._pending[name] = (compute, torch.is_grad_enabled())
        self._values[name] = None

    def _resolve(self) -> None:
        while self._pending:
            name, (compute, grad) = next(iter(self._pending.items()))
            with torch.set_grad_enabled(grad):
                self._values[name] = compute()
            del self._pending[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        self._resolve()
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"RouterLosses({dict(self)!r})"


@dataclass
class RouterOutput:
    """topk_idx int64 [T, K]; topk_weights fp32 [T, K]; probs fp32 [T, E] (the scores the
    auxiliary losses use); losses: name -> scalar (already multiplied by their coefficient;
    a `RouterLosses` mapping, whose global-batch loss is computed when first read);
    tokens_per_expert int64 [E] of this call."""

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    probs: torch.Tensor
    losses: Mapping
    tokens_per_expert: torch.Tensor


class TopKRouter(nn.Module):
    """Linear gate [E, H] + top-k selection. ``forward(x [..., H]) -> RouterOutput``.

    For ``seq_aux_loss`` give x as [B, S, H] (the loss is taken per sequence). ``load_group``
    is the process group over which expert loads are summed for the global auxiliary loss and
    the bias update (typically the EP x data-parallel ranks); None means this rank alone.
    """

    def __init__(self, config: RouterConfig, load_group=None):
        super().__init__()
        self.config = config
        self.load_group = load_group
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden))
        nn.init.normal_(self.weight, std=config.hidden ** -0.5)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer("load_since_update", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    # ------------------------------------------------------------------ scoring
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> fp32 [T, E]."""
        c = self.config
        if self.training and c.input_jitter > 0:
            noise = torch.empty_like(x, dtype=torch.float32).uniform_(1 - c.input_jitter, 1 + c.input_jitter)
            x = x * noise.to(x.dtype)
        return torch.nn.functional.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> RouterOutput:
        c = self.config
        if x.shape[-1] != c.hidden:
            raise InvalidInputError(f"router input has hidden size {x.shape[-1]}, expected {c.hidden}")
        seq_shape = x.shape[:-1]
        logits = self.logits(x.reshape(-1, c.hidden))
        idx, weights, probs = self.route(logits)
        tokens_per_expert = count_values(idx.reshape(-1), c.num_experts)
        losses = self.losses(logits, probs, idx, tokens_per_expert, seq_shape)
        if self.training and self.expert_bias is not None:
            self.load_since_update += tokens_per_expert.float()
        return RouterOutput(idx, weights, probs, losses, tokens_per_expert)

    def route(self, logits: torch.Tensor):
        """fp32 logits [T, E] -> (topk_idx [T, K], topk_weights [T, K], probs [T, E])."""
        c = self.config
        if c.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True).clamp(min=1e-20)
        elif c.pre_softmax:
            scores = probs = torch.softmax(logits, -1)
        else:
            scores, probs = logits, torch.softmax(logits, -1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if c.num_groups is not None:
            choice = self._limit_to_groups(choice)
        if c.force_balance:
            idx = balanced_topk(logits.shape[0], c.num_experts, c.topk, logits.device)
        else:
            idx = choice.topk(c.topk, dim=-1).indices
        picked = scores.gather(1, idx)
        if c.score_function == "softmax" and not c.pre_softmax:
            weights = torch.softmax(picked, -1)
        else:
            weights = picked
        if c.normalize_topk and (c.score_function == "sigmoid" or c.pre_softmax):
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
        return idx, weights * c.scaling_factor, probs

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (with -inf) the experts outside each token's ``group_topk`` best groups."""
        c = self.config
        grouped = choice.view(choice.shape[0], c.num_groups, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)                     # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(c.group_topk, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    # ------------------------------------------------------------------ losses
    def losses(self, logits, probs, idx, tokens_per_expert, seq_shape) -> RouterLosses:
        c = self.config
        out = RouterLosses()
        if not self.training:
            return out
        num_tokens = logits.shape[0]
        if c.aux_loss_coeff:
            out["aux_loss"] = c.aux_loss_coeff * switch_loss(probs.sum(0), tokens_per_expert, num_tokens, c.topk)
        if c.seq_aux_loss_coeff:
            if len(seq_shape) != 2:
                raise InvalidInputError("seq_aux_loss needs the router input as [batch, seq, hidden]")
            batch, seq = seq_shape
            per_seq = torch.zeros(batch, c.num_experts, device=idx.device)
            per_seq.scatter_add_(1, idx.view(batch, seq * c.topk), torch.ones(batch, seq * c.topk, device=idx.device))
            loss = sum(switch_loss(probs.view(batch, seq, -1)[b].sum(0), per_seq[b], seq, c.topk) for b in range(batch))
            out["seq_aux_loss"] = c.seq_aux_loss_coeff * loss / batch
        if c.global_aux_loss_coeff:
            # The expert loads of the whole global batch (summed over load_group, no gradient)
            # against this rank's mean scores: the gradient is the local one, as data-parallel
            # averaging expects.
            loads = torch.cat([tokens_per_expert.float(), torch.tensor([float(num_tokens)], device=idx.device)])
            work = None
            if self.load_group is not None:     # one small all-reduce, waited for when the loss is read
                work = Transfer(works=[dist.all_reduce(loads, group=self.load_group, async_op=True)])

            def global_aux_loss():
                if work is not None:            # a few numbers: waited for without giving the turn away
                    wait_exchange("router loads", work.wait, give_turn=False, watch=work)
                counts, total = loads[:-1], loads[-1]
                fraction = counts / (total * c.topk)
                return c.global_aux_loss_coeff * c.num_experts * (probs.mean(0) * fraction).sum()
            out.add_pending("global_aux_loss", global_aux_loss)
        if c.z_loss_coeff:
            out["z_loss"] = c.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
        return out

    # ------------------------------------------------------------------ aux-loss-free balancing
    @torch.no_grad()
    def update_expert_bias(self) -> torch.Tensor:
        """bias += rate * sign(mean load - load), with the loads counted since the last update
        summed over ``load_group``. Call once per optimizer step. Returns the loads used."""
        if self.expert_bias is None:
            raise ConfigError("update_expert_bias needs RouterConfig(expert_bias=True)")
        load = self.load_since_update.clone()
        if self.load_group is not None:
            dist.all_reduce(load, group=self.load_group)
        self.expert_bias += self.config.bias_update_rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()
        return load


def switch_loss(prob_sum: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens, topk: int) -> torch.Tensor:
    """Switch Transformer balance loss: E * sum_e (mean score of e) * (fraction of rows to e).

    prob_sum [E]: scores summed over the tokens; tokens_per_expert [E]: rows per expert.
    Equals 1 when both are uniform.
    """
    num_experts = prob_sum.shape[0]
    fraction = tokens_per_expert.float() / (num_tokens * topk)
    return num_experts * (prob_sum / num_tokens * fraction).sum()


def balanced_topk(num_tokens: int, num_experts: int, topk: int, device=None, offset: int = 0) -> torch.Tensor:
    """int64 [T, K]: slot k of token t gets expert (t*K + k + offset) mod E: every expert the
    same number of rows (within one), K distinct experts per token when K <= E."""
    slots = torch.arange(num_tokens * topk, device=device).view(num_tokens, topk) + offset
    return slots % num_experts
