"""Hot-expert load balancing: plan replicas and placement (NumPy, torch-free), route tokens to
replicas. See docs/balance.md."""
from .planner import Placement, balancedness, plan_placement, rank_loads

__all__ = ["Placement", "balancedness", "plan_placement", "rank_loads"]
