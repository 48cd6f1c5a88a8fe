"""expertrail: expert-parallel dispatch and combine for Mixture-of-Experts on PyTorch."""
from .dispatch import BACKENDS, DispatchResult, Dispatcher, TransferStats, make_dispatcher
from .errors import ConfigError, ConfigMismatchError, ExpertrailError, InvalidInputError
from .experts import GroupedExperts, SwiGLUMLP
from .layer import MoELayer, router_loss
from .router import RouterConfig, RouterOutput, TopKRouter
from .routing import (Layout, apply_capacity, compute_layout, routing_map_to_topk, topk_to_routing_map)
from .topology import EPGroups

__version__ = "0.1.0"

__all__ = ["BACKENDS", "ConfigError", "ConfigMismatchError", "DispatchResult", "Dispatcher", "EPGroups",
           "ExpertrailError", "GroupedExperts", "InvalidInputError", "Layout", "MoELayer", "RouterConfig",
           "RouterOutput", "SwiGLUMLP", "TopKRouter", "TransferStats", "apply_capacity", "compute_layout",
           "make_dispatcher", "router_loss", "routing_map_to_topk", "topk_to_routing_map"]
