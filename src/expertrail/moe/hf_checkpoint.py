"""Hugging Face checkpoints at real sizes: every rank reads and writes only its share.

`from_pretrained(path, groups)` builds the model on the meta device, patches it (`hf.patch_model`,
without the weight checksum: nothing is loaded yet), allocates what this rank keeps (the
replicated weights and its ``E_local`` expert slots per block) and reads exactly that from the
safetensors files: replicated tensors whole, expert tensors one expert row at a time
(``safe_open(...).get_slice``). The non-persistent buffers (rotary frequencies...) are then
computed as transformers computes them, and the replicated weights compared across the ranks.

`save_pretrained(model, directory)` is the reverse: each rank writes its experts, one tensor per
expert and projection under the names transformers' own ``save_pretrained`` gives them, into
its own shard files; EP rank 0 also writes the replicated tensors, the config and
``model.safetensors.index.json``. No rank ever holds all experts, and plain
``AutoModelForCausalLM.from_pretrained(directory)`` loads the result.

Checkpoint layouts read: the per-expert one (``<block>.experts.<e>.gate_proj.weight`` [F, H],
``up_proj`` [F, H], ``down_proj`` [H, F], or the names transformers' conversion mapping gives a
model family, e.g. Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2``), and the fused one
(``<block>.experts.gate_up_proj`` [E, 2F, H], ``<block>.experts.down_proj`` [E, H, F]).

Both functions are collective over the EP group, and every error is raised on every rank of it.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..comm.topology import EPGroups, all_gather_ints, guarded
from ..errors import ConfigError, ConfigMismatchError
from .hf import (ExpertParallelMoE, _agree_on_patched, _patched_blocks, is_sparse_moe_block, listed,
                 patch_model, replicated_drift)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Per-expert tensor names every model family of the qwen2_moe pattern uses; a family's own
# names (Mixtral's w1 / w3 / w2) come from transformers' conversion mapping.
DEFAULT_SUFFIXES = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}
_EXPERT_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<suffix>.+)$")


# --- agreement on errors --------------------------------------------------------------------

def _raise_together(problem: str | None, groups: EPGroups, what: str, cls=ConfigError) -> None:
    """Raise ``cls`` on every rank of the EP group if any rank has a ``problem`` (its message,
    or None), naming each failing rank's. Collective: one all-gather of a flag, and one of the
    messages when any is set."""
    with guarded(f"{what}'s agreement on errors", groups):
        flags = all_gather_ints([problem is not None], groups.ep_group, groups.device)
    if not any(f for (f,) in flags):
        return
    texts = [None] * groups.ep_size
    with guarded(f"{what}'s agreement on errors", groups):
        dist.all_gather_object(texts, problem, group=groups.ep_group)
    failed = [(groups.ep_ranks[r], t) for r, t in enumerate(texts) if t is not None]
    if len(failed) == 1 or len({t for _, t in failed}) == 1:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise cls(f"{what}: on rank(s) {ranks}: {failed[0][1]}")
    raise cls(f"{what} failed on ranks {[r for r, _ in failed]}:\n"
              + "\n".join(f"  rank {r}: {t}" for r, t in failed))


# --- the checkpoint's tensors, read lazily ----------------------------------------------------

class Checkpoint:
    """The tensors of a safetensors checkpoint directory (one ``model.safetensors`` or shards
    listed in ``model.safetensors.index.json``), known from the files' headers: nothing is
    read until `read` is called. ``tensors``: name -> (file, shape, dtype name)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise FileNotFoundError(f"neither {INDEX} nor {SINGLE} in {self.path}")
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for file in files:
            with safe_open(str(self.path / file), framework="pt") as f:
                for key in f.keys():
                    if weight_map is not None and weight_map.get(key) != file:
                        continue            # as transformers: the index says which tensors there are
                    s = f.get_slice(key)
                    self.tensors[key] = (file, tuple(s.get_shape()), s.get_dtype())
        if weight_map is not None:
            lost = sorted(k for k, file in weight_map.items() if self.tensors.get(k, (file,))[0] != file)
            if lost:
                raise FileNotFoundError(f"{INDEX} lists {len(lost)} tensors its files do not hold, e.g. {lost[0]} "
                                        f"in {weight_map[lost[0]]}")

    def signature(self) -> int:
        """crc32 of the names, shapes and dtypes: equal on ranks reading the same checkpoint."""
        text = ";".join(f"{k}:{s}:{d}" for k, (_, s, d) in sorted(self.tensors.items()))
        return zlib.crc32(text.encode())

    def read(self, jobs: list[tuple[str, int | None, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into ``jobs``' targets: (name, expert row or None for the
        whole tensor, target). One file open at a time, so that its mapped pages are let go
        before the next; an expert row is read alone (``get_slice``), not its whole tensor."""
        from safetensors import safe_open
        by_file: dict[str, list] = {}
        for job in jobs:
            by_file.setdefault(self.tensors[job[0]][0], []).append(job)
        with torch.no_grad():
            for file, file_jobs in sorted(by_file.items()):
                with safe_open(str(self.path / file), framework="pt") as f:
                    for key, row, target in file_jobs:
                        value = f.get_tensor(key) if row is None else f.get_slice(key)[row:row + 1][0]
                        target.copy_(value)
                        del value


# --- names: transformers' conversion mapping --------------------------------------------------

def _conversions(model: nn.Module, saving: bool):
    """(renamings, converters) transformers applies to ``model``'s checkpoint keys when loading."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    found = getattr(model, "_weight_conversions", None) if saving else None
    if found is None:
        found = get_model_conversion_mapping(model, add_legacy=not saving)
        if saving:            # a model not loaded by transformers: no prefix to put back
            found = [c for c in found if not isinstance(c, PrefixChange)]
    return ([c for c in found if isinstance(c, WeightRenaming)], [c for c in found if isinstance(c, WeightConverter)])


def expert_suffixes(converters, defaults: bool = True) -> dict[str, str]:
    """Per-expert tensor name suffix -> role (``gate``, ``up``, ``down``): the converters that
    stack per-expert tensors into the fused ones (merge over experts, then gate and up
    concatenated along dim 1, gate first), first; then (``defaults``) `DEFAULT_SUFFIXES`."""
    table = {}
    for c in converters:
        target, sources = c.target_patterns[0], c.source_patterns
        ops = [type(op).__name__ for op in getattr(c, "operations", [])]
        if target.endswith("experts.gate_up_proj") and len(sources) == 2 and ops == ["MergeModulelist", "Concatenate"] \
                and getattr(c.operations[1], "dim", None) == 1:
            roles = ("gate", "up")
        elif target.endswith("experts.down_proj") and len(sources) == 1 and ops == ["MergeModulelist"]:
            roles = ("down",)
        else:
            continue
        for source, role in zip(sources, roles):
            if ".*." in source:
                table.setdefault(source.split(".*.", 1)[1], role)
    for suffix, role in DEFAULT_SUFFIXES.items() if defaults else ():
        table.setdefault(suffix, role)
    return table


# --- loading ----------------------------------------------------------------------------------

def _sources(model: nn.Module, blocks: dict[str, ExpertParallelMoE], ckpt: Checkpoint):
    """Where each tensor this rank needs is in ``ckpt``; raises ConfigError naming what is
    missing, extra or of the wrong shape (the same on every rank: only names and shapes are read).

    Returns (plain: model key -> checkpoint key, experts: block path -> {"fused": {part: key}}
    or {"per_expert": {role: {e: key}}})."""
    from transformers.core_model_loading import rename_source_key
    renamings, converters = _conversions(model, saving=False)
    suffixes = expert_suffixes(converters)
    expert_keys = {f"{p}.experts.{n}" for p in blocks for n in ("gate_up_proj", "down_proj")}
    state = model.state_dict(keep_vars=True)
    needed = {k: t for k, t in state.items() if not k.endswith("_extra_state") and k not in expert_keys}
    base = getattr(model, "base_model_prefix", "")
    plain, experts, extra = {}, {p: {} for p in blocks}, []
    for key in ckpt.tensors:
        name, _ = rename_source_key(key, renamings, [], base or None, needed)
        m = _EXPERT_KEY.match(name)
        block = m and (m["block"] if m["block"] in blocks else f"{base}.{m['block']}")
        if m and block in blocks and m["suffix"] in suffixes:
            layout = experts[block].setdefault("per_expert", {})
            layout.setdefault(suffixes[m["suffix"]], {})[int(m["expert"])] = key
        elif name in expert_keys:
            block, _, part = name.rpartition(".experts.")
            experts[block].setdefault("fused", {})[part] = key
        elif name in needed:
            plain[name] = key
        else:
            extra.append(key)
    problems = []
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    extra = [k for k in extra if not any(p.search(k) for p in ignored) and not k.endswith("rotary_emb.inv_freq")]
    if extra:
        problems.append(f"{len(extra)} checkpoint tensors have no place in {type(model).__name__}: "
                        + ", ".join(sorted(extra)[:6]) + (" ..." if len(extra) > 6 else ""))
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    missing = [k for k in needed if k not in plain and k not in tied and not any(p.search(k) for p in ignored)]
    wrong = [f"{plain[k]} {tuple(ckpt.tensors[plain[k]][1])} for {k} {tuple(needed[k].shape)}"
             for k in plain if tuple(ckpt.tensors[plain[k]][1]) != tuple(needed[k].shape)]
    for path, block in blocks.items():
        found = experts[path]
        e_count, two_f, hidden = block.num_experts, 2 * block.experts.ffn_hidden, block.experts.hidden
        f = two_f // 2
        if len(found) > 1:
            problems.append(f"{path} has expert tensors in both layouts (fused experts.gate_up_proj and per-expert "
                            "experts.<e>.*): keep one")
            continue
        if "fused" in found:
            want = {"gate_up_proj": (e_count, two_f, hidden), "down_proj": (e_count, hidden, f)}
            for part, shape in want.items():
                key = found["fused"].get(part)
                if key is None:
                    missing.append(f"{path}.experts.{part}")
                elif ckpt.tensors[key][1] != shape:
                    wrong.append(f"{key} {ckpt.tensors[key][1]} for {path}.experts.{part} {shape}")
        else:
            roles = found.get("per_expert", {})
            want = {"gate": (f, hidden), "up": (f, hidden), "down": (hidden, f)}
            names = {r: next((s for s, rr in suffixes.items() if rr == r), r) for r in want}
            for role, shape in want.items():
                have = roles.get(role, {})
                lost = [e for e in range(e_count) if e not in have]
                if lost:
                    missing.append(f"{path}.experts.<e>.{names[role]} for experts {_ranges(lost)}")
                beyond = sorted(e for e in have if e >= e_count)
                if beyond:
                    problems.append(f"{path} has tensors for experts {_ranges(beyond)} but the config has {e_count} "
                                    "experts")
                wrong += [f"{have[e]} {ckpt.tensors[have[e]][1]}, expected {shape}"
                          for e in range(e_count) if e in have and ckpt.tensors[have[e]][1] != shape][:3]
    if missing:
        problems.append(f"{len(missing)} tensors of {type(model).__name__} are missing from the checkpoint: "
                        + ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""))
    if wrong:
        problems.append("tensors whose shapes do not match the config: " + "; ".join(wrong[:6])
                        + (" ..." if len(wrong) > 6 else ""))
    if extra and missing:
        problems.append("tensors missing and extra at once: the files hold another model than config.json describes")
    if problems:
        raise ConfigError(f"the checkpoint at {ckpt.path} does not fit the model its config.json describes:\n"
                          + "\n".join(f"  {p}" for p in problems) + "\nUse a checkpoint saved from this model "
                          "(its own config.json and safetensors files, all of them), or fix config.json.")
    return plain, experts


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}" if start == e else f"{start}-{e}")
            start = None
    return ", ".join(out)


def _read_jobs(model, blocks, plain, experts) -> list[tuple[str, int | None, torch.Tensor]]:
    """(checkpoint key, expert row or None, target view) for everything this rank keeps."""
    state = model.state_dict(keep_vars=True)
    jobs = [(ckpt_key, None, state[name]) for name, ckpt_key in plain.items()]
    for path, block in blocks.items():
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        f = gate_up.shape[1] // 2
        layout = experts[path]
        for i, e in enumerate(block.local_experts().tolist()):     # each slot from its logical expert
            if "fused" in layout:
                jobs += [(layout["fused"]["gate_up_proj"], e, gate_up[i]), (layout["fused"]["down_proj"], e, down[i])]
            else:
                roles = layout["per_expert"]
                jobs += [(roles["gate"][e], None, gate_up[i, :f]), (roles["up"][e], None, gate_up[i, f:]),
                         (roles["down"][e], None, down[i])]
    return jobs


def _compute_buffers(model: nn.Module) -> None:
    """Fill the non-persistent buffers (rotary ``inv_freq``...), which no checkpoint holds and
    `to_empty` left as garbage, as transformers does after its own loading: its
    ``_init_weights`` on the modules owning them, every loaded tensor marked initialised so
    that nothing else is touched. Raises ConfigError naming a buffer left unset."""
    from transformers import PreTrainedModel
    from transformers import initialization as init
    owners = [(name, m) for name, m in model.named_modules() if m._non_persistent_buffers_set]
    if not owners:
        return
    for t in [*model.parameters(), *model.buffers()]:
        t._is_hf_initialized = True
    pretrained = [(name, m) for name, m in model.named_modules() if isinstance(m, PreTrainedModel)]
    unset = []
    with torch.no_grad(), init.guard_torch_init_functions():
        for name, module in owners:
            for b in module._non_persistent_buffers_set:
                buf = getattr(module, b, None)
                if isinstance(buf, torch.Tensor):
                    buf._is_hf_initialized = False
                    if buf.is_floating_point():
                        buf.fill_(float("nan"))        # so that one left unset is seen below
            owner = max((p for p in pretrained if p[0] == "" or name.startswith(p[0] + ".")), key=lambda p: len(p[0]))
            owner[1]._init_weights(module)
            for b in module._non_persistent_buffers_set:
                buf = getattr(module, b, None)
                if isinstance(buf, torch.Tensor):
                    buf._is_hf_initialized = True
                    if buf.is_floating_point() and torch.isnan(buf).any():
                        unset.append(f"{name}.{b}" if name else b)
    if unset:
        raise ConfigError(f"from_pretrained could not compute the non-persistent buffers {unset} of "
                          f"{type(model).__name__} (its _init_weights does not set them): build the model with "
                          "transformers' from_pretrained and patch_model instead")


def from_pretrained(path: str | os.PathLike, groups: EPGroups, backend: str = "alltoall", dtype=None, device=None,
                    replicas=None, num_chunks: int = 1, check_weights: bool = True, **dispatcher_options) -> nn.Module:
    """A transformers causal LM from the checkpoint directory ``path``, expert parallel over
    ``groups`` (`hf.patch_model` with ``backend``, ``num_chunks``, ``replicas`` and
    ``dispatcher_options``), in eval mode, ready for training or ``generate``.

    Each rank reads only what it keeps: the replicated weights whole and, for each MoE block,
    its ``E_local`` slots' experts (each slot from its logical expert under ``replicas``), so
    its peak host memory is about those, not the whole model. ``dtype``: the parameters'
    dtype (default: the config's); ``device``: where they live (default: ``groups.device``).

    Collective over the EP group: every rank must pass the same checkpoint. Raises on every
    rank: ConfigError if a rank cannot read ``path``, the checkpoint does not fit its config
    (tensors missing, extra or of other shapes), the EP size does not divide the experts or
    a block cannot be made expert parallel; ConfigMismatchError if ranks read different
    checkpoints or (``check_weights``) hold different replicated weights after loading.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    what = "expertrail.hf.from_pretrained"
    config = ckpt = problem = None
    try:
        if not Path(path).is_dir():       # a hub name is not read here: download it first
            raise FileNotFoundError(f"no directory {str(path)!r} on this rank")
        config = AutoConfig.from_pretrained(str(path))
        ckpt = Checkpoint(path)
    except Exception as err:      # any reason this rank cannot read it: every rank must hear of it
        problem = (f"cannot read the checkpoint at path={str(path)!r} ({type(err).__name__}: "
                   f"{str(err).splitlines()[0][:300] if str(err) else ''}): every rank must be able to read the "
                   "same checkpoint directory (config.json and the safetensors files)")
    _raise_together(problem, groups, what)
    described = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    groups.check_same({"config.json (crc32)": zlib.crc32(json.dumps(described, sort_keys=True, default=str).encode()),
                       "checkpoint tensors: names, shapes and dtypes (crc32)": ckpt.signature()},
                      f"{what}'s checkpoint (path={str(path)!r})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))
    sizes = sorted({m.experts.gate_up_proj.shape[0] for m in model.modules() if is_sparse_moe_block(m)})
    slots = sizes if replicas is None else sorted({r.num_slots for r in (replicas if isinstance(replicas, (list, tuple))
                                                                         else [replicas])})
    if any(s % groups.ep_size for s in slots):
        raise ConfigError(f"{what}: the EP size {groups.ep_size} does not divide the "
                          f"{'expert slots' if replicas is not None else 'experts'} per MoE block ({slots}) of "
                          f"{path}: build the groups with an ep_size that divides them "
                          f"(EPGroups.from_default(ep_size=...)){'' if replicas is not None else ', or pass replicas= with a multiple of the EP size slots'}")
    patch_model(model, groups, backend, check_weights=False, num_chunks=num_chunks, replicas=replicas,
                **dispatcher_options)
    blocks = dict(_patched_blocks(model))
    plain, experts = _sources(model, blocks, ckpt)
    model.to_empty(device=device if device is not None else groups.device)
    problem = None
    try:
        ckpt.read(_read_jobs(model, blocks, plain, experts))
    except Exception as err:
        problem = f"reading {ckpt.path} failed: {type(err).__name__}: {str(err)[:300]}"
    _raise_together(problem, groups, what)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    _compute_buffers(model)
    if check_weights:
        drift = replicated_drift(model, list(blocks.items()))
        if drift:
            lines = [f"  {key} (ranks holding the same copy: {', '.join(map(str, copies))})" for key, copies in drift]
            raise ConfigMismatchError(f"{what}: the ranks of {groups.label} read different replicated weights from "
                                      f"{path}:\n" + listed(lines, "tensors") + "\nEvery rank must read the same "
                                      "files: copy the checkpoint whole to every node (or share one file system).")
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.name_or_path = str(path)
    return model.eval()


# --- saving -----------------------------------------------------------------------------------

def _shards(entries: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Pack (name, bytes) in order into files of at most ``limit`` bytes (a larger tensor alone)."""
    files, size = [[]], 0
    for name, nbytes in entries:
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return [f for f in files if f]


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB") -> None:
    """Save an expert-parallel model (patched by `hf.patch_model` or loaded by `from_pretrained`)
    as the unpatched model's Hugging Face checkpoint, each rank writing its own share.

    Each rank writes its experts (with replicas: the experts whose first slot it holds), one
    tensor per expert and projection under the names transformers gives them
    (``<block>.experts.<e>.gate_proj.weight [F, H]`` ..., Mixtral's ``w1 / w3 / w2``), into its
    own files of at most ``max_shard_size`` (``"5GB"``, ``"100MB"`` or bytes); EP rank 0 also
    writes the replicated tensors, ``config.json``, ``generation_config.json`` and
    ``model.safetensors.index.json``. No rank holds more than its own experts plus one file's
    copy. ``AutoModelForCausalLM.from_pretrained(save_directory)`` loads the result, as does
    `from_pretrained` at any EP size.

    Collective over the EP group; with several EP groups (world > EP size), over the default
    group: the EP group holding global rank 0 writes, and every rank returns once the files are
    complete (or raises why not). The replicated weights must be equal on every rank (see
    `hf.full_state_dict`'s ``check_replicas``): ConfigMismatchError on every rank otherwise.
    ConfigError for a model family transformers keeps no per-expert layout for.
    """
    what = "expertrail.hf.save_pretrained"
    blocks = _patched_blocks(model)
    if not blocks:
        raise ConfigError(f"{what}: {type(model).__name__} has no expert-parallel block; save an unpatched model "
                          "with its own model.save_pretrained(directory)")
    _agree_on_patched(blocks, f"{what}'s model")
    groups = blocks[0][1].groups
    drift = replicated_drift(model, blocks)
    if drift:
        raise ConfigMismatchError(f"{what}: the replicated weights differ between ranks of {groups.label} "
                                  f"({', '.join(k for k, _ in drift[:4])}{' ...' if len(drift) > 4 else ''}), so the "
                                  "checkpoint would hold none of the models the ranks run: sum the gradients of every "
                                  "parameter but the experts' over the ranks (DDP) before each step")
    if dist.get_world_size() == groups.ep_size:
        _write_shares(model, blocks, groups, save_directory, max_shard_size)
        return
    # Several EP groups hold the same model: the one with global rank 0 writes, and every rank
    # learns over the default group that the files are complete, or why not.
    problem = None
    if 0 in groups.ep_ranks:
        try:
            _write_shares(model, blocks, groups, save_directory, max_shard_size)
        except Exception as err:
            problem = str(err)
    with guarded(f"{what}'s end", "the default process group"):
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, problem)
    if any(f is not None for f in failed):
        raise ConfigError(f"{what} failed in the EP group writing the checkpoint: "
                          + next(f for f in failed if f is not None))


def _write_shares(model, blocks, groups: EPGroups, save_directory, max_shard_size) -> None:
    """`save_pretrained`'s writing, by the ranks of one EP group (collective over it)."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import apply_renamings
    from transformers.utils.hub import convert_file_size_to_int
    what = "expertrail.hf.save_pretrained"
    limit = convert_file_size_to_int(max_shard_size)
    renamings, _ = _conversions(model, saving=True)
    reverse = [c.reverse_transform() for c in renamings[::-1]]
    names = {}
    for suffix, role in expert_suffixes(_conversions(model, saving=False)[1], defaults=False).items():
        names.setdefault(role, suffix)
    if len(names) < 3:                      # the same on every rank: no collective needed to raise
        raise ConfigError(f"{what}: transformers has no per-expert checkpoint layout for "
                          f"{getattr(model.config, 'model_type', type(model).__name__)} (its conversion mapping does "
                          "not stack per-expert tensors), so the experts cannot be written rank by rank in files it "
                          "loads: gather them with expertrail.hf.full_state_dict(model) and save from one rank")
    # What this rank writes: name in the checkpoint -> a function giving the tensor.
    tensors: dict[str, tuple[int, callable]] = {}
    if groups.ep_rank == 0:
        expert_keys = {f"{p}.experts.{n}" for p, _ in blocks for n in ("gate_up_proj", "down_proj", "_extra_state")}
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        for key, t in model.state_dict().items():
            if key not in expert_keys and key not in tied and not key.endswith("_extra_state"):
                tensors[apply_renamings(key, reverse)] = (t.numel() * t.element_size(), lambda t=t: t)
    for path, block in blocks:
        gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        f = gate_up.shape[1] // 2
        first_slot = None if block.replicas is None else block.replicas.log_to_phys[:, 0].tolist()
        for i, e in enumerate(block.local_experts().tolist()):
            if first_slot is not None and first_slot[e] != block.first_expert + i:
                continue                    # a replica: the expert's first slot writes it
            row = gate_up.element_size() * f * gate_up.shape[2]
            for role, view in (("gate", lambda w=gate_up[i, :f]: w), ("up", lambda w=gate_up[i, f:]: w),
                               ("down", lambda w=down[i]: w)):
                tensors[apply_renamings(f"{path}.experts.{e}.{names[role]}", reverse)] = (row, view)
    files = _shards([(n, size) for n, (size, _) in tensors.items()], limit)
    directory = Path(save_directory)
    problem = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if groups.ep_rank == 0:             # a former save's files would mix with these
            for old in [*directory.glob("model-*-of-*.safetensors"), directory / SINGLE, directory / INDEX]:
                old.unlink(missing_ok=True)
    except OSError as err:
        problem = f"cannot write to save_directory={str(save_directory)!r}: {err}"
    _raise_together(problem, groups, what)          # also: nobody writes before the old files are gone
    with guarded(f"{what}'s file count", groups):
        counts = [c for (c,) in all_gather_ints([len(files)], groups.ep_group, groups.device)]
    total, first = sum(counts), sum(counts[:groups.ep_rank])
    weight_map, problem = {}, None
    try:
        for j, file in enumerate(files):
            fname = SINGLE if total == 1 else f"model-{first + j + 1:05d}-of-{total:05d}.safetensors"
            # Copies, one file at a time: a row of gate_up_proj shares its storage with the others.
            data = {n: tensors[n][1]().to("cpu", copy=True).contiguous() for n in file}
            save_file(data, str(directory / fname), metadata={"format": "pt"})
            del data
            weight_map.update({n: fname for n in file})
    except Exception as err:
        problem = f"writing the checkpoint to {directory} failed: {type(err).__name__}: {str(err)[:300]}"
    _raise_together(problem, groups, what)
    maps = [None] * groups.ep_size
    with guarded(f"{what}'s index", groups):
        dist.all_gather_object(maps, (weight_map, sum(tensors[n][0] for n in weight_map)), group=groups.ep_group)
    problem = None
    if groups.ep_rank == 0:
        try:
            if total > 1:
                full = {n: fname for m, _ in maps for n, fname in m.items()}
                index = {"metadata": {"total_size": sum(size for _, size in maps)},
                         "weight_map": dict(sorted(full.items()))}
                (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            model.config.save_pretrained(str(directory))
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(str(directory))
        except Exception as err:
            problem = f"writing the index and config to {directory} failed: {type(err).__name__}: {str(err)[:300]}"
    _raise_together(problem, groups, what)           # on return the checkpoint is complete on every rank
