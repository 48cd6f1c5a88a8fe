"""Hot-expert load balancing: plan replicas and placement (NumPy, torch-free), route tokens to
replicas. See docs/balance.md."""
from .planner import Placement, balancedness, plan_placement, rank_loads

__all__ = ["Placement", "balancedness", "plan_placement", "rank_loads"]


def __getattr__(name):            # the torch parts load on first use: the planner stays torch-free
    if name == "ReplicaRouter":
        from .replicas import ReplicaRouter
        return ReplicaRouter
    if name == "LoadRecorder":
        from .recorder import LoadRecorder
        return LoadRecorder
    if name == "migrate":
        from .migration import migrate
        return migrate
    raise AttributeError(name)
