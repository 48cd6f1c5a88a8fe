"""Hardware and model catalogs, extensible with a YAML/JSON file or a Hugging Face config.json.

Hardware figures are per GPU, from vendor datasheets (see shared reference notes): NVLink
bandwidth each way, NIC bandwidth (one rail per local GPU index), SMs, HBM size and
bandwidth, dense BF16 / FP8 FLOP/s. ``domain_size`` is the number of GPUs one NVLink domain
joins (8 for an HGX node, 72 / 36 for NVL72 / NVL36 racks).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError
from . import hf_fields


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
    # Measured machines (`expertrail bench --nodes ... --emit-hardware`): the link figures are
    # achieved bandwidths, taken as they are (no efficiency factor, no SM saturation), and each
    # exchange stage costs the measured latency instead of the GPU kernels' default.
    measured: bool = False
    nvlink_latency_us: float | None = None
    nic_latency_us: float | None = None
    # Measured machines only: how fast one rank copies rows (the gathers and expansions around
    # an exchange) and sums weighted copies of rows (combine's reductions) while every rank
    # does the same, GB/s of rows read. With them, predictions of expertrail's own engine add
    # its local passes (`cost.Traffic.passes`); GPU kernels (DeepEP, Hybrid-EP) fuse theirs into
    # the communication, so catalog entries leave them out.
    local_copy_GBps: float | None = None
    local_reduce_GBps: float | None = None
    # GPUs one node holds, for a run sized in nodes (a launcher's NNODES): 8 on a DGX / HGX node,
    # 4 on a Grace-Blackwell rack's compute tray.
    node_gpus: int = 8


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

    def router_fields(self) -> dict:
        """The Megatron-Core router fields a configuration of this model needs beside its expert
        count and top-k to pass Megatron-Core's checks: group-limited routing's groups, and for
        top-1 routing the softmax before top-k it requires."""
        fields = {"moe_router_pre_softmax": True} if self.topk == 1 else {}
        if self.num_groups:
            fields.update(moe_router_num_groups=self.num_groups, moe_router_group_topk=self.group_topk)
        return fields


HARDWARE = {h.name: h for h in [
    # DGX A100 (A100 SXM4 80GB datasheet: 312 BF16 TFLOPS dense, 2,039 GB/s HBM2e, NVLink 3 at
    # 600 GB/s both ways; one 200 Gb/s HDR InfiniBand NIC a GPU): no FP8, no published run fits its speed.
    Hardware("a100", 8, 300, 25, 108, 80, 2.039, 312, 0, "ampere"),
    Hardware("h100", 8, 450, 50, 132, 80, 3.35, 989, 1979, "hopper"),
    Hardware("h200", 8, 450, 50, 132, 141, 4.8, 989, 1979, "hopper"),
    Hardware("h800", 8, 160, 50, 132, 80, 3.35, 989, 1979, "hopper"),
    Hardware("b200", 8, 900, 50, 148, 180, 8.0, 2250, 4500, "blackwell"),
    Hardware("b300", 8, 900, 100, 148, 288, 8.0, 2250, 4500, "blackwell"),
    Hardware("gb200-nvl72", 72, 900, 50, 148, 186, 8.0, 2500, 5000, "blackwell", node_gpus=4),
    Hardware("gb300-nvl72", 72, 900, 100, 148, 288, 8.0, 2500, 5000, "blackwell", node_gpus=4),
    Hardware("gb200-nvl36", 36, 900, 50, 148, 186, 8.0, 2500, 5000, "blackwell", node_gpus=4),
]}

def read_mapping(path: Path, what: str) -> dict:
    """The mapping in a YAML/JSON file; every way it can be unreadable is a `ConfigError`."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} {str(path)!r}: cannot read it ({err.__class__.__name__}: {err})") from None
    if not text.strip():
        raise ConfigError(f"{what} {str(path)!r} is empty: give a YAML/JSON file with its fields")
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:                        # yaml.YAMLError, json.JSONDecodeError
        raise ConfigError(f"{what} {str(path)!r} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: "
                          f"{str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r}: expected a mapping of fields, got "
                          f"{'nothing' if data is None else type(data).__name__}")
    return data


def _build(cls, entry: dict, source: str):
    names = {f.name for f in fields(cls)}
    unknown = set(entry) - names
    if unknown:
        raise ConfigError(f"{source}: unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
    try:
        obj = cls(**entry)
    except TypeError as err:
        raise ConfigError(f"{source}: {err}") from None
    _check(obj, source)
    return obj


def _check(obj, source: str) -> None:
    """Numbers the models divide by must be numbers, and positive."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in ("name", "arch", "measured") or (value is None and f.default is None):
            continue
        if f.name in ("fp8_TFLOPS", "shared_experts") and value == 0:    # a GPU without FP8; no shared expert
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{source}: {f.name}={value!r}; give a positive number")
    if isinstance(obj, MoEModel):
        if obj.topk > obj.num_experts:
            raise ConfigError(f"{source}: topk {obj.topk} exceeds num_experts {obj.num_experts}")
        if obj.num_groups and (obj.num_experts % obj.num_groups or not obj.group_topk
                               or obj.group_topk > obj.num_groups):
            raise ConfigError(f"{source}: num_groups {obj.num_groups} must divide num_experts {obj.num_experts} "
                              f"and group_topk {obj.group_topk} must be 1..num_groups")


# Other spellings of catalog systems: Megatron-Bridge's performance tables and scripts call the
# NVL72 racks gb200 and gb300.
HARDWARE_ALIASES = {"gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
# Systems built on another catalog system's GPU at its clocks and power, which share its sustained
# compute speed (fitted per system where published runs pin it): H200 is H100's GPU with HBM3e,
# H800 H100's with fewer NVLink lanes, GB200 NVL36 the NVL72 rack's superchip.
SAME_GPU = {"h200": "h100", "h800": "h100", "gb200-nvl36": "gb200-nvl72"}


def gpu_twin(name: str) -> str:
    """The catalog system whose GPU ``name`` runs at the same clocks and power (`SAME_GPU`), or ``name``."""
    return SAME_GPU.get(name, name)


def hardware_key(name: str) -> str | None:
    """The catalog name ``name`` spells (any case, or an alias of `HARDWARE_ALIASES`), or None."""
    key = HARDWARE_ALIASES.get(str(name).lower(), str(name).lower())
    return key if key in HARDWARE else None


def load_hardware(name_or_file: str) -> Hardware:
    """A catalog name (any case; gb200 / gb300 for the NVL72 racks), or a YAML/JSON file holding
    one entry (or ``{hardware: [...]}``)."""
    key = hardware_key(name_or_file)
    if key:
        return HARDWARE[key]
    path = Path(name_or_file)
    if not path.is_file():
        raise ConfigError(f"--hardware {name_or_file!r}: " + ("a directory; " if path.is_dir() else "")
                          + f"choose one of {', '.join(HARDWARE)} or give a YAML/JSON file")
    data = read_mapping(path, "--hardware")
    if isinstance(data.get("hardware"), list):
        if not data["hardware"] or not isinstance(data["hardware"][0], dict):
            raise ConfigError(f"--hardware {name_or_file!r}: 'hardware' holds no entry")
        data = data["hardware"][0]
    return _build(Hardware, data, str(path))


_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def hub_cache_config(repo_id: str) -> Path | None:
    """The config.json of Hugging Face repository ``repo_id`` (``org/name``) in the local hub cache
    (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ~/.cache/huggingface/hub: where transformers
    and ``huggingface-cli download`` keep what they fetched), at the revision its ``refs/main``
    names, else its newest snapshot; None where the cache holds none. Nothing is downloaded."""
    if not _REPO_ID.fullmatch(repo_id):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    main = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / main.read_text().strip()] if main.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True) \
        if (repo / "snapshots").is_dir() else []
    return next((s / "config.json" for s in snapshots if (s / "config.json").is_file()), None)


def hf_config(name_or_file: str) -> tuple[dict, str] | None:
    """(config.json's contents, a name) of a Hugging Face model directory or config.json, or of a
    repository id (``deepseek-ai/DeepSeek-V2-Lite``) the local hub cache holds
    (`hub_cache_config`); None when ``name_or_file`` is none of them (a catalog name, a YAML/JSON
    file of other fields)."""
    path = Path(name_or_file)
    cached = None if path.exists() else hub_cache_config(str(name_or_file))
    if cached:
        return read_mapping(cached, "--model"), str(name_or_file).rsplit("/", 1)[-1]
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {name_or_file!r} is a directory without a config.json: give a Hugging Face "
                              f"model directory, its config.json, a YAML/JSON file, or one of {', '.join(_models())}")
        return read_mapping(path / "config.json", "--model"), path.name
    if path.is_file():
        data = read_mapping(path, "--model")
        if "hidden_size" in hf_fields.language_model(data):
            return data, path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return None


def leading_name(name: str, names, joiner: str = "-") -> str | None:
    """The longest of ``names`` that begins the last path part of ``name`` (a Hugging Face
    repository id: ``Qwen/Qwen3-30B-A3B-Instruct``), in any case, followed by nothing or by
    ``joiner`` ("-": a variant of that model; "": any name that begins so); None for none."""
    tail = str(name).rstrip("/").rsplit("/", 1)[-1].lower()
    for key in sorted(names, key=len, reverse=True):          # qwen3-next-80b-a3b before a shorter name
        if tail == key or tail.startswith(key + joiner):
            return key
    return None


def catalog_name(name: str, names) -> str | None:
    """The catalog name (one of ``names``) that ``name`` spells: itself in any case, or a Hugging
    Face repository id of that model or of a variant of it (``Qwen/Qwen3-30B-A3B``,
    ``moonshotai/Kimi-K2-Instruct``, ``mistralai/Mixtral-8x7B-v0.1``: the name, then ``-``
    and anything; a path of that name does not shadow the exact name), or Megatron-Bridge's recipe
    stem of it (``gpt_oss_20b``, ``qwen3_30b_a3b``: underscores for dashes); None for another
    existing path or a name of no catalog model."""
    for spelling in (name, str(name).replace("_", "-")):
        if spelling in names:
            return spelling
    return None if Path(name).exists() else leading_name(name, names)


def _models() -> dict:
    """The catalog's MoE models (`architecture.MODELS`: the MoE part of each whole-model shape)."""
    from .architecture import MODELS
    return MODELS


def load_model(name_or_file: str) -> MoEModel:
    """A catalog name, a YAML/JSON file with MoEModel fields, a Hugging Face config.json, or
    a Hugging Face model directory (its config.json)."""
    models = _models()
    key = catalog_name(name_or_file, models)
    if key:
        return models[key]
    found = hf_config(name_or_file)
    if found is not None:
        return from_hf_config(*found)
    path = Path(name_or_file)
    if not path.is_file():
        raise ConfigError(f"--model {name_or_file!r}: choose one of {', '.join(models)}, a YAML/JSON file, "
                          "a Hugging Face config.json or model directory, or a repository id the local Hugging Face "
                          "cache holds (`huggingface-cli download ORG/NAME config.json` fetches it)")
    return _build(MoEModel, read_mapping(path, "--model"), str(path))


def from_hf_config(cfg: dict, name: str = "hf-model") -> MoEModel:
    """The MoE shape of a transformers config.json, in any of the spellings `hf_fields` reads
    (a multimodal file's ``text_config``); layers the planner cannot cost are refused by name."""
    cfg = hf_fields.language_model(cfg)
    hf_fields.type_problems(cfg, name)
    experts = hf_fields.routed_experts(cfg, name)
    hf_fields.family_problems(cfg, name)
    missing = [k for k in ("hidden_size", "num_hidden_layers") if not cfg.get(k)]
    topk = hf_fields.topk(cfg, name)
    if not topk:
        missing.append(f"num_experts_per_tok (or {' / '.join(hf_fields.TOPK_KEYS[1:])}: the experts a token picks)")
    ffn = hf_fields.expert_width(cfg)
    if not ffn:
        missing.append("moe_intermediate_size")
    if missing:
        raise ConfigError(f"{name}: config.json lacks {', '.join(missing)}; the planner needs them")
    shared = hf_fields.shared_width(cfg, ffn)
    model = MoEModel(name=cfg.get("model_type", name), hidden=cfg["hidden_size"], num_experts=experts,
                     topk=topk, moe_ffn=ffn, layers=cfg["num_hidden_layers"] - hf_fields.dense_layers(cfg),
                     shared_experts=-(-shared // ffn), num_groups=cfg.get("n_group"), group_topk=cfg.get("topk_group"))
    _check(model, f"{name} config.json")
    return model
