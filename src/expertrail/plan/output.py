"""JSON output of the planner commands: booleans as booleans and numbers as numbers.

`jsonable` turns NumPy scalars into the Python value they hold and tuples into lists, and
refuses anything else that JSON cannot hold, so a value never silently becomes a string
(``"ep_overlap": "True"``).
"""
from __future__ import annotations

import json
import math

import numpy as np


def jsonable(obj, path: str = "$", fallback=None):
    """``obj`` with every value a JSON type; raises TypeError naming the first that is not, unless
    ``fallback`` (e.g. ``str``, for values a user's YAML holds, such as dates) converts it."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise TypeError(f"{path}: {obj} has no JSON form")
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v, f"{path}.{k}", fallback) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, f"{path}[{i}]", fallback) for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist(), path, fallback)
    if fallback is not None:
        return fallback(obj)
    raise TypeError(f"{path}: {type(obj).__name__} {obj!r} has no JSON form")


def dumps(obj, fallback=None) -> str:
    return json.dumps(jsonable(obj, fallback=fallback), indent=2)
