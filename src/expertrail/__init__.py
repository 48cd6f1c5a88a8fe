"""expertrail: expert-parallel dispatch and combine for Mixture-of-Experts on PyTorch.

Names are loaded on first use, so that the torch-free parts (``expertrail.plan`` and the
planner's commands) can be imported where PyTorch is not installed.
"""
from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "BACKENDS": "dispatch", "DispatchResult": "dispatch", "Dispatcher": "dispatch", "TransferStats": "dispatch",
    "make_dispatcher": "dispatch", "LowLatencyDispatcher": "dispatch", "LowLatencyResult": "dispatch",
    "CollectiveError": "errors", "ConfigError": "errors", "ConfigMismatchError": "errors", "ExpertrailError": "errors",
    "InvalidInputError": "errors",
    "GroupedExperts": "experts", "SwiGLUMLP": "experts",
    "MoELayer": "layer", "router_loss": "layer", "exclude_experts_from_ddp": "layer",
    "RouterConfig": "router", "RouterOutput": "router", "TopKRouter": "router",
    "TokenLayout": "routing", "apply_capacity": "routing", "compute_layout": "routing",
    "routing_map_to_topk": "routing", "topk_to_routing_map": "routing",
    "EPGroups": "topology",
}

# Submodules reachable as attributes (``er.hf``) without an import of their own.
_SUBMODULES = {"hf", "schedule"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)      # importing binds it in globals()
    raise AttributeError(f"module 'expertrail' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
