"""expertrail: expert-parallel dispatch and combine for Mixture-of-Experts on PyTorch.

The package's layers (docs/architecture.md draws them; tests/test_imports.py enforces them):
``comm`` (EP groups, transport, the overlap schedule), ``kernels`` and ``dispatch`` (the
engine), ``moe`` (router, experts, the MoE layer, Hugging Face blocks), ``balance`` (hot
experts), ``plan`` (the torch-free planner), ``emulation`` (the emulated cluster, local
ranks) and ``tools`` (the ``expertrail`` command and what it runs); ``errors`` and ``names``
are the facts every layer shares.

Names are loaded on first use, so that the torch-free parts (``expertrail.plan`` and the
planner's commands) can be imported where PyTorch is not installed.
"""
import sys
from importlib import import_module
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader

__version__ = "0.1.0"

_EXPORTS = {
    "BACKENDS": "dispatch", "DispatchResult": "dispatch", "Dispatcher": "dispatch", "TransferStats": "dispatch",
    "make_dispatcher": "dispatch", "LowLatencyDispatcher": "dispatch", "LowLatencyResult": "dispatch",
    "CollectiveError": "errors", "ConfigError": "errors", "ConfigMismatchError": "errors", "ExpertrailError": "errors",
    "InvalidInputError": "errors",
    "GroupedExperts": "moe.experts", "SwiGLUMLP": "moe.experts",
    "MoELayer": "moe.layer", "router_loss": "moe.layer", "exclude_experts_from_ddp": "moe.layer",
    "RouterConfig": "moe.router", "RouterOutput": "moe.router", "TopKRouter": "moe.router",
    "TokenLayout": "dispatch.routing", "apply_capacity": "dispatch.routing", "compute_layout": "dispatch.routing",
    "routing_map_to_topk": "dispatch.routing", "topk_to_routing_map": "dispatch.routing",
    "EPGroups": "comm.topology",
}

# Submodules reachable as attributes (``er.hf``) without an import of their own.
_SUBMODULES = {"hf": "moe.hf", "schedule": "comm.schedule", "fp8": "kernels.fp8"}

# Modules that lived at the top of the package before it had subpackages: their old names
# (``expertrail.hf``) still import the moved module itself, for one release.
_MOVED = {
    "topology": "comm.topology", "transport": "comm.transport", "schedule": "comm.schedule",
    "routing": "dispatch.routing", "reference": "dispatch.reference",
    "workspace": "kernels.workspace", "fp8": "kernels.fp8",
    "router": "moe.router", "experts": "moe.experts", "layer": "moe.layer", "hf": "moe.hf",
    "replicated": "moe.replicated",
    "cluster": "emulation.cluster", "links": "emulation.links", "launch": "emulation.launch",
    "cli": "tools.cli", "bench": "tools.bench", "bench_decode": "tools.bench_decode", "train": "tools.train",
    "serving": "tools.serving", "serve_sim": "tools.commands.serve_sim", "workload": "tools.workload",
    "configs": "tools.configs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = import_module(f".{_SUBMODULES[name]}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'expertrail' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


class _MovedModules(MetaPathFinder, Loader):
    """Imports ``expertrail.<old name>`` as the module it moved to (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        if old == fullname or old not in _MOVED:
            return None
        return spec_from_loader(fullname, self)

    def create_module(self, spec):
        return import_module(f"{__name__}.{_MOVED[spec.name.removeprefix(f'{__name__}.')]}")

    def exec_module(self, module):
        pass                          # the moved module ran when it was imported under its own name


sys.meta_path.append(_MovedModules())
