"""`expertrail validate`: check a Megatron-Core / Megatron-Bridge MoE config before launch.

A config is a YAML or JSON file (flat, or nested as Bridge's ``model:`` / ``comm_overlap:``
sections) and/or ``key=value`` overrides (``model.expert_model_parallel_size=8``); dashes and
section prefixes are ignored, so Megatron's command-line names work too. Each rule names the
fields it reads and the fix; a field that is absent takes Megatron's default or, where no
default decides it, leaves the rule out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from .catalog import HARDWARE, load_hardware
from .simulate import domain_for

FLEX_BACKENDS = ("deepep", "hybridep")
DOMAIN_FIELD = "num_of_hybrid_ep_ranks_per_nvlink_domain"

# Megatron-Core defaults for the fields the rules read.
DEFAULTS = {
    "expert_model_parallel_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1, "moe_token_dispatcher_type": "allgather", "moe_router_topk": 2,
    "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss",
}


def parse_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", ""):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip().strip("'\"")


def _key(name: str) -> str:
    return name.strip().lstrip("-").split(".")[-1].replace("-", "_").lower()


def _flatten(data: dict, out: dict) -> dict:
    for k, v in data.items():
        if isinstance(v, dict):
            _flatten(v, out)
        else:
            out[_key(str(k))] = v
    return out


def load_config(source: str | None = None, overrides: list | None = None) -> dict:
    """Flat config from a YAML/JSON file (optional) plus ``key=value`` overrides."""
    cfg = {}
    if source is not None:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"config file {source!r} not found (give a YAML/JSON file or key=value overrides)")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of config fields")
        _flatten(data, cfg)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: write key=value, e.g. model.expert_model_parallel_size=8")
        key, value = item.split("=", 1)
        cfg[_key(key)] = parse_value(value)
    return cfg


class Config:
    """Read access with Megatron's defaults."""

    def __init__(self, values: dict):
        self.values = values

    def __getitem__(self, name):
        return self.values.get(name, DEFAULTS.get(name))

    def given(self, name) -> bool:
        return self.values.get(name) is not None

    @property
    def ep(self) -> int:
        return int(self["expert_model_parallel_size"])

    @property
    def world(self) -> int | None:
        if self.given("world_size"):
            return int(self["world_size"])
        if self.given("num_nodes") and self.given("gpus_per_node"):
            return int(self["num_nodes"]) * int(self["gpus_per_node"])
        return None

    @property
    def hardware(self):
        return load_hardware(str(self["hardware"])) if self.given("hardware") else None

    @property
    def domain(self) -> int | None:
        return int(self[DOMAIN_FIELD]) if self.given(DOMAIN_FIELD) else None


@dataclass(frozen=True)
class Rule:
    """A rule: when ``applies``, ``holds`` must be true; else the fix is printed."""

    id: str
    title: str
    fields: tuple
    fix: str
    applies: Callable
    holds: Callable


@dataclass
class Violation:
    rule: str
    title: str
    fields: dict
    fix: str

    def format(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"[{self.rule}] {self.title}\n    fields: {shown}\n    fix: {self.fix}"


def _overlap(c):
    return bool(c["overlap_moe_expert_parallel_comm"])


def _delayed(c):
    return bool(c["delay_wgrad_compute"])


def _version(text) -> tuple:
    return tuple(int(p) for p in str(text).split("+")[0].split(".")[:3] if p.isdigit())


def _graph_scope(c) -> str:
    impl, scope = c["cuda_graph_impl"], c["cuda_graph_scope"]
    return "" if impl in (None, "none") else str(scope or "")


def _expected_domain(c) -> int:
    return domain_for(c.hardware, c.ep)


RULES = [
    # EP communication overlap (overlap_moe_expert_parallel_comm)
    Rule("ep-overlap-ep", "EP overlap needs expert parallelism (EP > 1)", ("overlap_moe_expert_parallel_comm",
         "expert_model_parallel_size"), "set expert_model_parallel_size > 1, or turn the overlap off",
         _overlap, lambda c: c.ep > 1),
    Rule("ep-overlap-experts", "EP overlap needs more than one expert", ("num_moe_experts",),
         "set num_moe_experts > 1", _overlap, lambda c: (c["num_moe_experts"] or 0) > 1),
    Rule("ep-overlap-dispatcher", "EP overlap needs the alltoall or flex dispatcher", ("moe_token_dispatcher_type",),
         "set moe_token_dispatcher_type to 'alltoall' (or 'flex' with a DeepEP/HybridEP backend)",
         _overlap, lambda c: c["moe_token_dispatcher_type"] in ("alltoall", "flex")),
    Rule("ep-overlap-precision", "EP overlap needs BF16 or FP16", ("bf16", "fp16"), "set bf16=true",
         _overlap, lambda c: bool(c["bf16"]) or bool(c["fp16"])),
    Rule("ep-overlap-torch", "EP overlap needs PyTorch >= 2.6 (older versions hang)", ("torch_version",),
         "upgrade PyTorch to 2.6.0 or newer", lambda c: _overlap(c) and c.given("torch_version"),
         lambda c: _version(c["torch_version"]) >= (2, 6)),
    Rule("ep-overlap-vpp", "EP overlap with pipeline parallelism needs virtual pipeline stages",
         ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
         "set virtual_pipeline_model_parallel_size when pipeline_model_parallel_size > 1",
         lambda c: _overlap(c) and int(c["pipeline_model_parallel_size"]) > 1,
         lambda c: c.given("virtual_pipeline_model_parallel_size")),
    Rule("ep-overlap-recompute", "EP overlap does not work with full recompute",
         ("recompute_granularity", "recompute_method", "recompute_num_layers"),
         "use selective recompute (recompute_granularity='selective') and unset recompute_method / "
         "recompute_num_layers", _overlap,
         lambda c: c["recompute_granularity"] != "full" and c["recompute_method"] is None
         and c["recompute_num_layers"] is None),
    Rule("ep-overlap-shared", "EP overlap needs the shared-expert overlap off", ("moe_shared_expert_overlap",),
         "set moe_shared_expert_overlap=false", _overlap, lambda c: not c["moe_shared_expert_overlap"]),
    Rule("ep-overlap-mtp", "EP overlap supports at most one MTP layer", ("mtp_num_layers",),
         "set mtp_num_layers to 1 or unset it", _overlap, lambda c: c["mtp_num_layers"] in (None, 0, 1)),
    # Delayed weight-gradient computation
    Rule("wgrad-needs-overlap", "delay_wgrad_compute needs EP overlap", ("delay_wgrad_compute",
         "overlap_moe_expert_parallel_comm"), "enable overlap_moe_expert_parallel_comm first (or turn "
         "delay_wgrad_compute off)", _delayed, _overlap),
    Rule("wgrad-graph-fusion", "CUDA graphs over attention with delayed wgrad need gradient accumulation fusion",
         ("cuda_graph_impl", "cuda_graph_scope", "gradient_accumulation_fusion"),
         "set gradient_accumulation_fusion=true (or keep attention out of the CUDA graph scope)",
         lambda c: _delayed(c) and "attn" in _graph_scope(c),
         lambda c: c["gradient_accumulation_fusion"] is not False),
    Rule("wgrad-graph-bias", "CUDA graphs over attention with delayed wgrad do not support attention bias",
         ("cuda_graph_scope", "add_bias_linear", "add_qkv_bias"), "set add_bias_linear=false and add_qkv_bias=false",
         lambda c: _delayed(c) and "attn" in _graph_scope(c),
         lambda c: not c["add_bias_linear"] and not c["add_qkv_bias"]),
    # Dispatchers
    Rule("flex-backend", "the flex dispatcher needs a DeepEP or HybridEP backend (else it brings no gain)",
         ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend"),
         "call apply_flex_dispatcher_backend(cfg.model, 'deepep' | 'hybridep'), i.e. set "
         "moe_flex_dispatcher_backend", lambda c: c["moe_token_dispatcher_type"] == "flex",
         lambda c: c["moe_flex_dispatcher_backend"] in FLEX_BACKENDS),
    Rule("flex-no-pad", "the flex dispatcher (DeepEP/HybridEP) does not pad experts to capacity",
         ("moe_token_dispatcher_type", "moe_pad_expert_input_to_capacity"),
         "set moe_pad_expert_input_to_capacity=false, or use the alltoall dispatcher",
         lambda c: c["moe_token_dispatcher_type"] == "flex", lambda c: not c["moe_pad_expert_input_to_capacity"]),
    Rule("flex-gpu", "DeepEP / HybridEP run only on Ampere, Hopper or Blackwell GPUs (else silently skipped)",
         ("moe_flex_dispatcher_backend", "hardware"), "run on Ampere/Hopper/Blackwell or use the alltoall dispatcher",
         lambda c: c["moe_flex_dispatcher_backend"] in FLEX_BACKENDS and c.given("hardware"),
         lambda c: c.hardware.arch in ("ampere", "hopper", "blackwell")),
    Rule("shared-overlap-dispatcher", "moe_shared_expert_overlap needs the alltoall or flex dispatcher",
         ("moe_shared_expert_overlap", "moe_token_dispatcher_type"),
         "set moe_token_dispatcher_type='alltoall' or turn moe_shared_expert_overlap off",
         lambda c: bool(c["moe_shared_expert_overlap"]), lambda c: c["moe_token_dispatcher_type"] in ("alltoall", "flex")),
    # Router and capacity
    Rule("capacity-balancing", "a capacity factor works only with aux_loss, seq_aux_loss, global_aux_loss or none "
         "load balancing", ("moe_expert_capacity_factor", "moe_router_load_balancing_type"),
         "set moe_router_load_balancing_type to aux_loss (or seq_aux_loss / global_aux_loss / none)",
         lambda c: c.given("moe_expert_capacity_factor"),
         lambda c: c["moe_router_load_balancing_type"] in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")),
    Rule("pad-needs-capacity", "padding experts to capacity needs a capacity factor",
         ("moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"), "set moe_expert_capacity_factor",
         lambda c: bool(c["moe_pad_expert_input_to_capacity"]), lambda c: c.given("moe_expert_capacity_factor")),
    Rule("group-divides-experts", "group-limited routing: the groups must split the experts evenly",
         ("num_moe_experts", "moe_router_num_groups"), "choose moe_router_num_groups dividing num_moe_experts",
         lambda c: c.given("moe_router_num_groups") and c.given("num_moe_experts"),
         lambda c: c["num_moe_experts"] % c["moe_router_num_groups"] == 0),
    Rule("group-topk", "group-limited routing: group_topk groups must exist and hold the top-k experts",
         ("moe_router_group_topk", "moe_router_num_groups", "moe_router_topk", "num_moe_experts"),
         "set 1 <= moe_router_group_topk <= moe_router_num_groups with group_topk x experts per group >= topk",
         lambda c: c.given("moe_router_num_groups") and c.given("num_moe_experts"),
         lambda c: c.given("moe_router_group_topk") and 1 <= c["moe_router_group_topk"] <= c["moe_router_num_groups"]
         and c["moe_router_group_topk"] * (c["num_moe_experts"] // c["moe_router_num_groups"]) >= c["moe_router_topk"]),
    Rule("top1-pre-softmax", "top-1 softmax routing needs the softmax before top-k",
         ("moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax"), "set moe_router_pre_softmax=true",
         lambda c: int(c["moe_router_topk"]) == 1 and c["moe_router_score_function"] == "softmax"
         and c["moe_router_load_balancing_type"] != "sinkhorn", lambda c: bool(c["moe_router_pre_softmax"])),
    Rule("bias-needs-sigmoid", "the expert bias (aux-loss-free balancing) needs sigmoid scores",
         ("moe_router_enable_expert_bias", "moe_router_score_function"), "set moe_router_score_function='sigmoid'",
         lambda c: bool(c["moe_router_enable_expert_bias"]), lambda c: c["moe_router_score_function"] == "sigmoid"),
    # Parallel layout
    Rule("experts-divide-ep", "the experts must split evenly over the EP ranks", ("num_moe_experts",
         "expert_model_parallel_size"), "choose expert_model_parallel_size dividing num_moe_experts",
         lambda c: c.given("num_moe_experts"), lambda c: c["num_moe_experts"] % c.ep == 0),
    Rule("parallel-sizes", "TP x PP x CP x DP must equal the world size",
         ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
          "data_parallel_size"), "choose sizes whose product is the number of GPUs (DP = world / (TP x PP x CP))",
         lambda c: c.world is not None,
         lambda c: c.world % (c["tensor_model_parallel_size"] * c["pipeline_model_parallel_size"]
                              * c["context_parallel_size"]) == 0
         and (not c.given("data_parallel_size") or c["tensor_model_parallel_size"] * c["pipeline_model_parallel_size"]
              * c["context_parallel_size"] * c["data_parallel_size"] == c.world)),
    Rule("expert-parallel-sizes", "EP x expert-TP must divide the ranks of one pipeline stage",
         ("world_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size"),
         "choose expert_model_parallel_size x expert_tensor_parallel_size dividing world_size / "
         "pipeline_model_parallel_size", lambda c: c.world is not None,
         lambda c: (c.world // c["pipeline_model_parallel_size"])
         % (c.ep * (c["expert_tensor_parallel_size"] or c["tensor_model_parallel_size"])) == 0),
    Rule("domain-divides-ep", "the NVLink domain size must divide EP", (DOMAIN_FIELD, "expert_model_parallel_size"),
         "set NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to a divisor of EP (the GPUs one NVLink domain joins)",
         lambda c: c.domain is not None, lambda c: c.ep % c.domain == 0),
    Rule("domain-matches-hardware", "the NVLink domain size must match the hardware",
         (DOMAIN_FIELD, "hardware", "expert_model_parallel_size"),
         "set NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to the largest divisor of EP that fits one NVLink domain "
         "of the hardware", lambda c: c.domain is not None and c.given("hardware"),
         lambda c: c.domain == _expected_domain(c)),
]


def validate(values: dict) -> list:
    """Violations of `RULES` by a flat config dict (see `load_config`)."""
    c = Config(values)
    if c.given("hardware") and str(c["hardware"]) not in HARDWARE and not Path(str(c["hardware"])).exists():
        raise ConfigError(f"hardware={c['hardware']!r}: choose one of {sorted(HARDWARE)} or give a YAML/JSON file")
    out = []
    for rule in RULES:
        try:
            broken = rule.applies(c) and not rule.holds(c)
        except (TypeError, ValueError, ZeroDivisionError) as err:
            broken = True
            rule = Rule(rule.id, f"{rule.title} (could not evaluate: {err})", rule.fields, rule.fix,
                        rule.applies, rule.holds)
        if broken:
            shown = {f: c[f] for f in rule.fields}
            if rule.id == "domain-matches-hardware":
                shown["expected"] = _expected_domain(c)
            out.append(Violation(rule.id, rule.title, shown, rule.fix))
    return out
