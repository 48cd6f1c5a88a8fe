"""Hardware and model catalogs, extensible with a YAML/JSON file or a Hugging Face config.json.

Hardware figures are per GPU, from vendor datasheets (see shared reference notes): NVLink
bandwidth each way, NIC bandwidth (one rail per local GPU index), SMs, HBM size and
bandwidth, dense BF16 / FP8 FLOP/s. ``domain_size`` is the number of GPUs one NVLink domain
joins (8 for an HGX node, 72 / 36 for NVL72 / NVL36 racks).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    domain_size: int
    nvlink_GBps: float          # per GPU, each way
    nic_GBps: float             # per GPU
    sms: int
    hbm_GB: float
    hbm_TBps: float
    bf16_TFLOPS: float          # dense
    fp8_TFLOPS: float           # dense
    arch: str                   # ampere / hopper / blackwell


@dataclass(frozen=True)
class MoEModel:
    name: str
    hidden: int
    num_experts: int
    topk: int
    moe_ffn: int                # intermediate size of one routed expert
    layers: int                 # MoE layers
    shared_experts: int = 0
    num_groups: int | None = None
    group_topk: int | None = None


HARDWARE = {h.name: h for h in [
    Hardware("h100", 8, 450, 50, 132, 80, 3.35, 989, 1979, "hopper"),
    Hardware("h200", 8, 450, 50, 132, 141, 4.8, 989, 1979, "hopper"),
    Hardware("h800", 8, 160, 50, 132, 80, 3.35, 989, 1979, "hopper"),
    Hardware("b200", 8, 900, 50, 148, 180, 8.0, 2250, 4500, "blackwell"),
    Hardware("b300", 8, 900, 100, 148, 288, 8.0, 2250, 4500, "blackwell"),
    Hardware("gb200-nvl72", 72, 900, 50, 148, 186, 8.0, 2500, 5000, "blackwell"),
    Hardware("gb300-nvl72", 72, 900, 100, 148, 288, 8.0, 2500, 5000, "blackwell"),
    Hardware("gb200-nvl36", 36, 900, 50, 148, 186, 8.0, 2500, 5000, "blackwell"),
]}

MODELS = {m.name: m for m in [
    MoEModel("deepseek-v3", 7168, 256, 8, 2048, 58, shared_experts=1, num_groups=8, group_topk=4),
    MoEModel("qwen3-235b-a22b", 4096, 128, 8, 1536, 94),
    MoEModel("qwen3-30b-a3b", 2048, 128, 8, 768, 48),
    MoEModel("qwen3-next-80b-a3b", 2048, 512, 10, 512, 48, shared_experts=1),
    MoEModel("mixtral-8x7b", 4096, 8, 2, 14336, 32),
    MoEModel("mixtral-8x22b", 6144, 8, 2, 16384, 56),
]}


def _read(path: Path) -> dict:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml
        return yaml.safe_load(text) or {}
    return json.loads(text)


def _build(cls, entry: dict, source: str):
    names = {f.name for f in fields(cls)}
    unknown = set(entry) - names
    if unknown:
        raise ConfigError(f"{source}: unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
    try:
        return cls(**entry)
    except TypeError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_hardware(name_or_file: str) -> Hardware:
    """A catalog name, or a YAML/JSON file holding one entry (or ``{hardware: [...]}``)."""
    if name_or_file in HARDWARE:
        return HARDWARE[name_or_file]
    path = Path(name_or_file)
    if not path.exists():
        raise ConfigError(f"unknown hardware {name_or_file!r}: choose one of {sorted(HARDWARE)} or give a YAML/JSON file")
    data = _read(path)
    entry = data["hardware"][0] if isinstance(data.get("hardware"), list) else data
    return _build(Hardware, entry, str(path))


def load_model(name_or_file: str) -> MoEModel:
    """A catalog name, a YAML/JSON file with MoEModel fields, or a Hugging Face config.json."""
    if name_or_file in MODELS:
        return MODELS[name_or_file]
    path = Path(name_or_file)
    if not path.exists():
        raise ConfigError(f"unknown model {name_or_file!r}: choose one of {sorted(MODELS)}, a YAML/JSON file, "
                          "or a Hugging Face config.json")
    data = _read(path)
    if "hidden_size" in data:
        return from_hf_config(data, path.stem)
    return _build(MoEModel, data, str(path))


def from_hf_config(cfg: dict, name: str = "hf-model") -> MoEModel:
    """The MoE shape of a transformers config.json (Qwen3-MoE, Mixtral, DeepSeek-V3 styles)."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ConfigError(f"{name}: config.json has no n_routed_experts / num_experts / num_local_experts: not MoE")
    ffn = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    dense_layers = cfg.get("first_k_dense_replace", 0) or 0
    return MoEModel(name=cfg.get("model_type", name), hidden=cfg["hidden_size"], num_experts=experts,
                    topk=cfg["num_experts_per_tok"], moe_ffn=ffn, layers=cfg["num_hidden_layers"] - dense_layers,
                    shared_experts=cfg.get("n_shared_experts") or (1 if cfg.get("shared_expert_intermediate_size") else 0),
                    num_groups=cfg.get("n_group"), group_topk=cfg.get("topk_group"))
