"""Expert parallelism for Hugging Face transformers MoE models (transformers 5.x).

transformers 5 keeps a sparse MoE block's experts fused in 3D parameters
(``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``) next to its router
(``gate``, returning ``(logits, topk_weights, topk_idx)``), in Qwen3-MoE, Mixtral,
DeepSeek-V3, ERNIE 4.5 and OLMoE alike. `ExpertParallelMoE` keeps the block's own router (and shared experts),
keeps this rank's slice of the experts as `GroupedExperts`, and moves tokens with an
expertrail dispatcher. `patch_model` does it for every MoE block of a model.

Checks made at patch time, so that a patched model is never silently wrong:

- the block computes ``experts(gate(x)) [+ shared_experts(x)]`` with plain SwiGLU experts
  (`why_unsupported` names what else it holds: a shared-expert gate, a clamped activation,
  expert biases...), and a model without any such block is an error;
- every rank of the EP group holds the same router, shared experts and full expert tensors
  (a checksum compared across ranks), since each rank keeps only its slice of the experts.

Checkpoints at real sizes: `from_pretrained` and `save_pretrained` (moe/hf_checkpoint.py, re-exported
here) read and write only each rank's share of a Hugging Face checkpoint. A patched model's
``generate`` runs with ``synced_gpus=True``, so ranks that finish early keep taking part.

Saving: a patched model's ``state_dict()`` is this rank's shard (expert tensors of
``E_local`` rows, plus ``_extra_state`` naming the rows); `full_state_dict` gathers the
checkpoint of the unpatched model on every rank (small models), and `unpatch_model` turns the
blocks back.
"""
from __future__ import annotations

import copy
import types
import zlib

import torch
from torch import nn

from ..dispatch import make_dispatcher
from ..errors import ConfigError, ConfigMismatchError
from .experts import GroupedExperts
from .layer import exclude_experts_from_ddp, expert_parallel_moe
from .bucketed import attach_step, bucketed_or_none, check_buckets, detach_step
from .replicated import SEED_ADVICE, differing, listed, tensor_checksum  # noqa: F401  (tensor_checksum: public here too)
from ..comm.topology import EPGroups, all_gather_single, guarded

# What ExpertParallelMoE reproduces. A block or experts module holding anything else may
# compute something the adapter does not (a gated shared expert, a routed scaling factor,
# a clamped SwiGLU...), so it is refused rather than patched into a different function.
_BLOCK_CHILDREN = {"gate", "experts", "shared_experts"}
_BLOCK_ATTRIBUTES = {"training", "config", "top_k", "jitter_noise", "hidden_dim", "num_experts"}
_EXPERTS_ATTRIBUTES = {"training", "config", "num_experts", "hidden_dim", "intermediate_dim", "act_fn",
                       "has_gate", "has_bias", "has_post_expert_norm", "is_transposed", "is_concatenated"}
# Flags transformers' @use_experts_implementation sets: the layout GroupedExperts computes.
_EXPERTS_FLAGS = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False,
                  "is_concatenated": True}
RECOGNISED = ("a module with a router `gate` (returning (logits, topk_weights, topk_idx)) and an `experts` "
              "module holding fused 3D weights gate_up_proj [E, 2F, H] and down_proj [E, H, F], "
              "and optionally `shared_experts` (transformers>=5; tested against the original: Qwen3MoeSparseMoeBlock, "
              "MixtralSparseMoeBlock, DeepseekV3MoE, Ernie4_5_MoeSparseMoeBlock, OlmoeSparseMoeBlock)")


def is_sparse_moe_block(module: nn.Module) -> bool:
    """A transformers-5 style MoE block: a ``gate`` and ``experts`` with fused 3D weights."""
    experts = getattr(module, "experts", None)
    weight = getattr(experts, "gate_up_proj", None)
    return hasattr(module, "gate") and isinstance(weight, torch.Tensor) and weight.dim() == 3 \
        and not isinstance(module, ExpertParallelMoE)


def _public_attributes(module: nn.Module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def why_unsupported(block: nn.Module) -> str | None:
    """Why `ExpertParallelMoE` cannot reproduce ``block``, or None when it can.

    Supported: a `is_sparse_moe_block` whose forward is ``experts(gate(x)) [+ shared_experts(x)]``
    with SwiGLU-style experts ``down @ (act(gate @ x) * (up @ x))``, no biases, gate rows first.
    Anything else the block or its experts hold is refused by name.
    """
    if not is_sparse_moe_block(block):
        experts = getattr(block, "experts", None)
        if hasattr(block, "gate") and isinstance(experts, nn.ModuleList):
            return ("its experts are an nn.ModuleList of per-expert MLPs (the transformers 4.x layout); "
                    "install transformers>=5, which fuses them into 3D gate_up_proj / down_proj")
        return f"it is not {RECOGNISED}"
    reasons = []
    extra_children = sorted(n for n, m in block.named_children() if n not in _BLOCK_CHILDREN and m is not None)
    if extra_children:
        reasons.append(f"the block has submodules {extra_children}")
    own = sorted(n for n, _ in block.named_parameters(recurse=False)) + sorted(n for n, _ in block.named_buffers(recurse=False))
    if own:
        reasons.append(f"the block has its own parameters/buffers {own}")
    attrs = sorted(k for k, v in _public_attributes(block).items() if k not in _BLOCK_ATTRIBUTES and v is not None)
    if attrs:
        reasons.append(f"the block has attributes {attrs}")
    experts = block.experts
    params = sorted(n for n, _ in experts.named_parameters())
    if params != ["down_proj", "gate_up_proj"]:
        reasons.append(f"its experts hold parameters {params}, not just gate_up_proj and down_proj")
    buffers = sorted(n for n, _ in experts.named_buffers())
    if buffers:
        reasons.append(f"its experts hold buffers {buffers}")
    extra = sorted(k for k, v in _public_attributes(experts).items() if k not in _EXPERTS_ATTRIBUTES and v is not None)
    extra += sorted(n for n, _ in experts.named_children() if n != "act_fn")
    if extra:
        reasons.append(f"its experts have attributes {extra} (e.g. a clamped or biased activation)")
    flags = {k: getattr(experts, k) for k in _EXPERTS_FLAGS if getattr(experts, k, _EXPERTS_FLAGS[k]) != _EXPERTS_FLAGS[k]}
    if flags:
        reasons.append(f"its experts use another layout: {flags} (expected {_EXPERTS_FLAGS})")
    gate_up, down = experts.gate_up_proj, getattr(experts, "down_proj", None)
    e, two_f, h = gate_up.shape
    if not isinstance(down, torch.Tensor) or tuple(down.shape) != (e, h, two_f // 2) or two_f % 2:
        shape = tuple(down.shape) if isinstance(down, torch.Tensor) else None
        reasons.append(f"experts.gate_up_proj {tuple(gate_up.shape)} and experts.down_proj {shape} are not "
                       "[E, 2F, H] and [E, H, F]")
    if not reasons:
        return None
    return "; ".join(reasons) + ", which ExpertParallelMoE does not reproduce"


# --- cross-rank check of the replicated weights -------------------------------------------

def _replicated_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what every EP rank must hold identically: the router, the shared
    experts and the full expert tensors (each rank slices its own rows out of them)."""
    named = []
    for part in ("gate", "shared_experts"):
        module = getattr(block, part, None)
        if isinstance(module, nn.Module):
            named += [(f"{part}.{n}", t) for n, t in [*module.named_parameters(), *module.named_buffers()]]
    for name in ("gate_up_proj", "down_proj"):
        t = getattr(block.experts, name, None)
        if isinstance(t, torch.Tensor):
            named.append((f"experts.{name}", t))
    return named


def _agree_on_structure(named_blocks: list[tuple[str, nn.Module]], groups: EPGroups, patched: int = 0) -> None:
    """Raise ConfigMismatchError on every rank unless all ranks of the EP group found the same
    blocks (paths, classes, tensor names, shapes, dtypes) and the same number ``patched`` of
    blocks made expert parallel already. Collective; run before any check that may raise on
    one rank only, so that such a check raises on all ranks alike."""
    text = ";".join(f"{path}:{type(b).__name__}:" + ",".join(f"{n}{tuple(t.shape)}{t.dtype}" for n, t in _replicated_tensors(b))
                    for path, b in named_blocks)
    groups.check_same({"expert-parallel blocks already there": patched, "MoE blocks found": len(named_blocks),
                       "their paths, classes and weight shapes (crc32)": zlib.crc32(text.encode())},
                      "the model being made expert parallel")


def _compare_checksums(named_blocks: list[tuple[str, nn.Module]], groups: EPGroups) -> None:
    """Raise ConfigMismatchError on every rank of the EP group unless all its ranks hold the
    same router, shared experts and full expert tensors in ``named_blocks`` ((path, block)
    pairs, in the same order on every rank, as `_agree_on_structure` checked), compared by
    `tensor_checksum`. Collective: one small all-gather."""
    entries = [((path, name), t) for path, b in named_blocks for name, t in _replicated_tensors(b)]
    names_of: dict[str, list[str]] = {}
    holders: dict[str, set] = {}
    for (path, name), copies in differing(entries, groups):
        names_of.setdefault(path, []).append(name)
        holders.setdefault(path, set()).update(tuple(r) for r in copies)
    if not names_of:
        return
    lines = [f"  {path}: {', '.join(names)} differ (ranks holding the same copy: "
             f"{', '.join(str(list(r)) for r in sorted(holders[path]))})" for path, names in names_of.items()]
    raise ConfigMismatchError(
        f"the MoE weights differ between ranks of {groups.label}; each rank keeps only its slice of the experts "
        "and its own router, so the expert-parallel model would compute a different function from every rank's "
        "original:\n" + listed(lines, "blocks") + f"\nEvery rank must hold the same model before patching: {SEED_ADVICE}.")


# --- the adapter ------------------------------------------------------------------------

class ExpertParallelMoE(nn.Module):
    """A transformers sparse MoE block whose experts are sharded over ``groups``' EP group.

    ``forward(hidden_states [..., H]) -> [..., H]`` equals the original block's (within float
    rounding) on every backend; each rank keeps experts ``[r * E_local, (r + 1) * E_local)``
    as ``experts.gate_up_proj [E_local, 2F, H]`` and ``experts.down_proj [E_local, H, F]``.

    Collective: every rank of the EP group must wrap the same block (same weights: checked,
    unless ``check_weights=False``) and call forward together. ``block`` itself is left as
    it was. ``state_dict()`` is this rank's shard, tagged with its expert rows; loading a
    full (unpatched) checkpoint slices this rank's rows. `full_expert_weights` and `unpatch`
    gather the full experts back. ``num_chunks > 1`` runs the routed part in chunks whose
    transfers overlap the expert compute, as `MoELayer` does (`layer.expert_parallel_moe`).
    """

    holds_expert_shard = True          # for layer.exclude_experts_from_ddp

    def __init__(self, block: nn.Module, groups: EPGroups, backend: str = "alltoall", check_weights: bool = True,
                 num_chunks: int = 1, replicas=None, buckets=None, **dispatcher_options):
        super().__init__()
        if int(num_chunks) < 1:
            raise ConfigError(f"num_chunks={num_chunks} must be >= 1")
        if replicas is not None:
            replicas.agree(groups, "ExpertParallelMoE expert placement")
        named = [(type(block).__name__, block)]
        if check_weights and is_sparse_moe_block(block):
            _agree_on_structure(named, groups)    # so that the checks below raise on every rank alike
        reason = why_unsupported(block)
        if reason is not None:
            raise ConfigError(f"cannot make {type(block).__name__} expert parallel: {reason}. "
                              f"Supported: {RECOGNISED}")
        if check_weights:
            _compare_checksums(named, groups)
        fused = block.experts
        num_experts, two_f, hidden = fused.gate_up_proj.shape
        if replicas is not None and replicas.log_to_phys.shape[0] != num_experts:
            raise ConfigError(f"replicas map {replicas.log_to_phys.shape[0]} experts but {type(block).__name__} has "
                              f"{num_experts}: plan the placement for this block's experts")
        self.gate = block.gate
        self.shared_experts = getattr(block, "shared_experts", None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.num_chunks = int(num_chunks)
        slots = num_experts if replicas is None else replicas.num_slots
        self.dispatcher = make_dispatcher(backend, groups, num_experts=slots, hidden=hidden, **dispatcher_options)
        self.groups, self.replicas = groups, replicas
        self.num_experts = num_experts
        self.bucketed = bucketed_or_none(groups, self.dispatcher, buckets)     # decode through the low-latency mode
        local = self.dispatcher.num_local_experts
        first = groups.ep_rank * local
        weight = fused.gate_up_proj
        self.experts = GroupedExperts(local, hidden, two_f // 2, dtype=weight.dtype, device=weight.device,
                                      activation=getattr(fused, "act_fn", nn.functional.silu))
        self.first_expert = first
        with torch.no_grad():
            rows = self.local_experts().to(weight.device)
            self.experts.gate_up_proj.copy_(fused.gate_up_proj.index_select(0, rows))
            self.experts.down_proj.copy_(fused.down_proj.index_select(0, rows))
        self.experts.gate_up_proj.requires_grad_(fused.gate_up_proj.requires_grad)
        self.experts.down_proj.requires_grad_(fused.down_proj.requires_grad)
        # The block to give back on `unpatch`: the same router and shared experts objects (so
        # it sees their training), the full expert tensors replaced by meta placeholders (so
        # no rank keeps all experts). Kept out of the module tree: not a submodule, not saved.
        memo = {id(self.gate): self.gate}
        if self.shared_experts is not None:
            memo[id(self.shared_experts)] = self.shared_experts
        for p in (fused.gate_up_proj, fused.down_proj):
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        object.__setattr__(self, "_original", copy.deepcopy(block, memo))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:     # Mixtral's input jitter
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_idx = self.gate(flat)
        if self.replicas is not None:
            topk_idx = self.replicas(topk_idx.long())
        shared = None if self.shared_experts is None else \
            (lambda: self.shared_experts(hidden_states).reshape(flat.shape))
        if self.bucketed is not None:
            return self.bucketed.moe(flat, topk_idx, topk_weights, self.experts, shared, self.num_chunks).view(shape)
        return expert_parallel_moe(self.dispatcher, flat, topk_idx, topk_weights, self.experts, shared,
                                   self.num_chunks).view(shape)

    # -- hot-expert replicas --

    def slot_experts(self) -> torch.Tensor:
        """int64 [S]: the logical expert each physical slot holds (S = E without replicas)."""
        if self.replicas is None:
            return torch.arange(self.num_experts)
        return self.replicas.slot_experts.cpu()

    def local_experts(self) -> torch.Tensor:
        """int64 [E_local]: the logical expert of each of this rank's expert rows."""
        return self.slot_experts()[self.first_expert:self.first_expert + self.experts.num_local_experts]

    def set_replicas(self, replicas, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Route through the placement ``replicas`` (a balance.ReplicaRouter with the same
        number of slots) from now on: each rank receives the expert weights its new slots lack
        from a rank that holds them (`balance.migrate`), and with ``optimizer`` the expert
        parameters' per-slot state (momenta...) moves with them. Collective over the EP group;
        the block's outputs are unchanged."""
        from ..balance import migrate
        replicas.agree(self.groups, "ExpertParallelMoE expert placement")
        if replicas.num_slots != self.dispatcher.num_experts or replicas.log_to_phys.shape[0] != self.num_experts:
            raise ConfigError(f"replicas has {replicas.num_slots} slots for {replicas.log_to_phys.shape[0]} experts, "
                              f"this block {self.dispatcher.num_experts} slots for {self.num_experts}: the slot count "
                              "is fixed at construction (pass replicas= there)")
        old, new = self.slot_experts().numpy(), replicas.slot_experts.cpu().numpy()
        params = [self.experts.gate_up_proj, self.experts.down_proj]
        states = [] if optimizer is None else [(p, name) for p in params for name, t in optimizer.state.get(p, {}).items()
                                               if torch.is_tensor(t) and t.shape == p.shape]
        tensors = [p.detach() for p in params] + [optimizer.state[p][name] for p, name in states]
        moved = migrate(tensors, old, new, self.groups.ep_rank, list(self.groups.ep_ranks), self.groups.ep_group)
        with torch.no_grad():
            for p, t in zip(params, moved):
                p.copy_(t)
        for (p, name), t in zip(states, moved[len(params):]):
            optimizer.state[p][name].copy_(t)
        self.replicas = replicas

    # -- saving and loading --

    def get_extra_state(self) -> torch.Tensor:
        """int64 [3] (first expert row, E_local, E) of the expert rows in this shard; with
        replicas [4], the placement's digest added."""
        tag = [self.first_expert, self.experts.num_local_experts, self.num_experts]
        return torch.tensor(tag if self.replicas is None else tag + [self.replicas.digest()])

    def set_extra_state(self, state) -> None:
        have = [int(v) for v in torch.as_tensor(state).tolist()]
        mine = self.get_extra_state().tolist()
        if have[3:] != mine[3:]:
            raise ConfigMismatchError("this state dict's expert shard was saved under another replica placement (or "
                                      "none): load it into a block with the same replicas, or save with "
                                      "expertrail.hf.full_state_dict(model)")
        if have != mine:
            a, n, e = have[:3]
            raise ConfigMismatchError(
                f"this state dict holds experts [{a}, {a + n}) of {e}, but this rank holds experts "
                f"[{mine[0]}, {mine[0] + mine[1]}) of {mine[2]}: a patched model's state_dict() is one rank's shard. "
                "Load on each rank the shard that rank saved, with the same EP size, or save with "
                "expertrail.hf.full_state_dict(model), which any rank (and the unpatched model) can load.")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A full checkpoint (the unpatched block's, or full_state_dict's) has E expert rows and
        # no expert-row tag: keep this rank's rows. load_state_dict hands children this dict
        # (its own copy), so the rows replaced here are the ones experts loads.
        # When a shard also has E rows, only the missing tag tells a full checkpoint.
        tag = prefix + "_extra_state"
        ambiguous = self.experts.num_local_experts == self.num_experts
        full = []
        for name in ("gate_up_proj", "down_proj"):
            key = f"{prefix}experts.{name}"
            t = state_dict.get(key)
            if t is not None and t.dim() == 3 and t.shape[0] == self.num_experts and not (ambiguous and tag in state_dict):
                state_dict[key] = t.index_select(0, self.local_experts().to(t.device))
                full.append(key)
        if full and tag in state_dict:
            raise ConfigMismatchError(f"{', '.join(full)} hold all {self.num_experts} experts but the state dict also "
                                      f"has {tag}, which marks a one-rank shard: the state dict mixes two formats")
        if full:
            state_dict[tag] = self.get_extra_state()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def full_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full expert tensors, gathered from the EP group: ``gate_up_proj [E, 2F, H]`` and
        ``down_proj [E, H, F]``, detached, on this rank's expert device. Collective. With
        replicas each expert's first slot stands for it (replicas of one expert are trained
        apart: each slot gets the gradient of the tokens routed to it)."""
        return self._gather(self.experts.gate_up_proj), self._gather(self.experts.down_proj)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        g = self.groups
        src = local.detach().to(g.device).contiguous()
        out = torch.empty((g.ep_size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=g.device)
        with guarded("the expert all_gather", g):
            all_gather_single(out, src, group=g.ep_group)
        if self.replicas is not None:
            out = out.index_select(0, self.replicas.log_to_phys[:, 0].to(out.device))
        return out.to(local.device)

    def unpatch(self) -> nn.Module:
        """The original transformers block with the full (current) expert weights, gathered
        from the EP group, and this module's router and shared experts. Collective."""
        gate_up, down = self.full_expert_weights()
        block = self._original
        block.experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=self.experts.gate_up_proj.requires_grad)
        block.experts.down_proj = nn.Parameter(down, requires_grad=self.experts.down_proj.requires_grad)
        return block.to(gate_up.device).train(self.training)


# --- whole models -------------------------------------------------------------------------

def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def patch_model(model: nn.Module, groups: EPGroups, backend: str = "alltoall", check_weights: bool = True,
                num_chunks: int = 1, replicas=None, buckets=None, **dispatcher_options) -> int:
    """Replace every sparse MoE block of ``model`` by an `ExpertParallelMoE` (``backend``,
    ``num_chunks`` and ``dispatcher_options`` as it takes them); returns how many.
    ``replicas``: None, one balance.ReplicaRouter for every block, or a list of them, one per
    block in module order (``Placement`` layer i for block i). ``buckets`` (with ``backend="dedup"``):
    steps at decode sizes run through the low-latency mode, chosen once per forward of ``model``
    (`bucketed`).

    Collective: every rank of the EP group must patch the same model. Before anything is
    replaced, the ranks agree on the blocks found, and (unless ``check_weights=False``) on
    a checksum of each block's router, shared experts and full expert tensors.

    Raises ConfigError (on every rank) if the model has no sparse MoE block (a dense model:
    nothing to make expert parallel) or has one `ExpertParallelMoE` cannot reproduce
    (`why_unsupported`), ConfigMismatchError if ranks hold different weights.
    """
    if is_sparse_moe_block(model):
        raise ConfigError(f"model is itself a sparse MoE block ({type(model).__name__}), which patch_model cannot "
                          "replace in place: use ExpertParallelMoE(block, groups) instead")
    targets = [(name, m) for name, m in model.named_modules() if is_sparse_moe_block(m)]
    patched = _patched_blocks(model)
    _agree_on_structure(targets, groups, len(patched))      # collective: from here on every rank raises alike
    if patched:
        raise ConfigError(f"{type(model).__name__} is already expert parallel ({len(patched)} blocks patched, e.g. "
                          f"{patched[0][0] or 'the model itself'}): call patch_model once per model; to change the "
                          "backend or EP size, unpatch_model(model) first, then patch it again")
    if not targets:
        legacy = [name for name, m in model.named_modules()
                  if hasattr(m, "gate") and isinstance(getattr(m, "experts", None), nn.ModuleList)]
        hint = (f" {legacy[0]} looks like a transformers 4.x MoE block (experts in an nn.ModuleList): install "
                "transformers>=5." if legacy else " A dense model has nothing to shard over experts: run it without "
                "expert parallelism, or check the model class.")
        raise ConfigError(f"patch_model found no transformers-5 sparse MoE block in {type(model).__name__}; it "
                          f"recognises {RECOGNISED}.{hint}")
    refused = [(name, type(m).__name__, why_unsupported(m)) for name, m in targets]
    refused = [r for r in refused if r[2] is not None]
    if refused:
        raise ConfigError("patch_model cannot make these MoE blocks expert parallel without changing what they "
                          "compute:\n" + "\n".join(f"  {name} ({cls}): {why}" for name, cls, why in refused[:8])
                          + f"\nSupported: {RECOGNISED}")
    if check_weights:
        _compare_checksums(targets, groups)
    per_block = replicas if isinstance(replicas, (list, tuple)) else [replicas] * len(targets)
    if len(per_block) != len(targets):
        raise ConfigError(f"replicas lists {len(per_block)} placements for {len(targets)} MoE blocks: give one per "
                          "block, in module order, or one for all")
    for (name, block), placement in zip(targets, per_block):
        _replace(model, name, ExpertParallelMoE(block, groups, backend, check_weights=False, num_chunks=num_chunks,
                                                replicas=placement, buckets=buckets, **dispatcher_options))
    if buckets is not None and check_buckets(buckets):
        attach_step(model, [m.bucketed for _, m in _patched_blocks(model)])
    exclude_experts_from_ddp(model)
    # Instance attributes, until unpatch_model.
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = _refuse_save_pretrained
    if callable(getattr(model, "generate", None)):
        model.generate = types.MethodType(_synced_generate, model)     # bound: a deepcopy rebinds it
    return len(targets)


def _refuse_save_pretrained(*args, **kwargs):
    raise ConfigError("save_pretrained on a patched model would write this rank's experts only, a checkpoint that "
                      "fails when loaded: call expertrail.hf.save_pretrained(model, directory) on every rank (each "
                      "writes its own experts), or gather the unpatched model's state with "
                      "expertrail.hf.full_state_dict(model) (collective, small models) and save that from one rank, "
                      "or unpatch_model(model) (collective) and then call save_pretrained on one rank")


def _synced_generate(model, *args, **kwargs):
    """The model class's ``generate`` with ``synced_gpus=True`` unless the caller says
    otherwise: a rank whose sequences are done keeps running forward passes (transformers' own
    loop: an all_reduce of a "finished" flag over the default process group each step) until
    every rank is, so the MoE layers' exchanges never miss a rank. Every rank of the default
    group must call it."""
    kwargs.setdefault("synced_gpus", True)
    return type(model).generate(model, *args, **kwargs)


def _patched_blocks(model: nn.Module) -> list[tuple[str, ExpertParallelMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]


def _agree_on_patched(blocks: list[tuple[str, ExpertParallelMoE]], what: str) -> None:
    if blocks:
        shapes = ";".join(f"{n}:{tuple(m.experts.gate_up_proj.shape)}:{m.num_experts}" for n, m in blocks)
        g = blocks[0][1].groups
        g.check_same({"patched MoE blocks": len(blocks), "their paths and shapes (crc32)": zlib.crc32(shapes.encode())},
                     what)


def replicated_drift(model: nn.Module, blocks: list[tuple[str, ExpertParallelMoE]],
                     state: dict | None = None) -> list[tuple[str, list[list[int]]]]:
    """(key, global ranks grouped by the copy they hold) of every entry of ``model``'s state
    dict but the experts (routers, shared experts, attention, embeddings...) whose bytes
    differ across the EP group of ``blocks`` (its patched blocks, non-empty). Collective: one
    all-gather of two ints per tensor. Plain tensors are compared; subclasses (DTensor) not."""
    state = model.state_dict() if state is None else state
    sharded = {f"{name}.{key}" if name else key for name, _ in blocks
               for key in ("experts.gate_up_proj", "experts.down_proj", "_extra_state")}
    return differing([(k, t) for k, t in state.items() if k not in sharded and type(t) is torch.Tensor],
                     blocks[0][1].groups)


def full_state_dict(model: nn.Module, check_replicas: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as the unpatched model has it: every `ExpertParallelMoE`'s
    experts gathered to the full ``experts.gate_up_proj [E, 2F, H]`` and
    ``experts.down_proj [E, H, F]`` under the original keys, without the shard tags.

    For small models: collective over the EP group, every rank gets the whole dict (so it
    costs the full expert memory on every rank). At real sizes use `save_pretrained`, which
    writes each rank's share. Load it into the unpatched model (``load_state_dict``),
    or into a patched one of any EP size (it takes its own rows), or save it from one rank.

    The other entries (routers, shared experts, attention...) are this rank's copies. With
    ``check_replicas`` (default) they must be bitwise equal on every rank of the EP group,
    else ConfigMismatchError on every rank: replicas drift apart when their gradients are
    not summed over the ranks (DDP or an all_reduce), and one rank's checkpoint then stands
    for that rank only. Plain tensors are compared; tensor subclasses (DTensor) are not.
    """
    blocks = _patched_blocks(model)
    _agree_on_patched(blocks, "full_state_dict's model")
    state = model.state_dict()
    if not blocks:
        return state
    if check_replicas:
        groups = blocks[0][1].groups
        drift = replicated_drift(model, blocks, state)
        if drift:
            lines = [f"  {key} (ranks holding the same copy: {', '.join(map(str, copies))})" for key, copies in drift]
            raise ConfigMismatchError(
                f"full_state_dict: the replicated weights differ between ranks of {groups.label}, so this rank's "
                "checkpoint would not hold the model the other ranks run:\n" + listed(lines, "tensors") + "\nSum the "
                "gradients of every parameter but the experts' over the ranks before each step (DDP, or "
                "torch.distributed.all_reduce), or pass check_replicas=False to save this rank's copy anyway.")
    for name, block in blocks:
        prefix = f"{name}." if name else ""
        state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"] = block.full_expert_weights()
        state.pop(prefix + "_extra_state", None)
    return state


def unpatch_model(model: nn.Module) -> int:
    """Turn every `ExpertParallelMoE` of ``model`` back into its original transformers block
    with the full current expert weights (gathered from the EP group); returns how many.

    Collective: every rank of the EP group must call it. The unpatched model runs on one
    rank without any process group, and ``save_pretrained`` / ``state_dict`` give the
    usual checkpoint.
    """
    blocks = _patched_blocks(model)
    _agree_on_patched(blocks, "unpatch_model's model")
    if blocks and blocks[0][0] == "":
        raise ConfigError("model is itself an ExpertParallelMoE: call model.unpatch() to get the original block")
    for name, block in blocks:
        _replace(model, name, block.unpatch())
    if vars(model).get("save_pretrained") is _refuse_save_pretrained:
        del model.save_pretrained
    if getattr(vars(model).get("generate"), "__func__", None) is _synced_generate:
        del model.generate
    detach_step(model)                         # the bucket agreement's hooks, if patched with buckets
    if blocks:
        exclude_experts_from_ddp(model)        # the experts are plain parameters again: DDP may sync them
    return len(blocks)


def __getattr__(name: str):
    # Loading and saving at real sizes live in their own module, which builds on this one:
    # reached from here on first use, so that either module may be imported first.
    if name in ("from_pretrained", "save_pretrained"):
        from . import hf_checkpoint
        return getattr(hf_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
