"""The planner: catalogs of hardware and models, and the config validator.

Pure Python (no torch import), so it runs on a laptop: ``import expertrail.plan`` and
``expertrail validate`` never load PyTorch.
"""
from .architecture import MODELS
from .catalog import HARDWARE, Hardware, MoEModel, load_hardware, load_model
from .validate import RULES, Violation, load_config, validate

__all__ = ["HARDWARE", "MODELS", "Hardware", "MoEModel", "RULES", "Violation", "load_config", "load_hardware",
           "load_model", "validate"]
