"""Cost model of the simulated engine: CPU phase, launch, GPU pass and GC costs for a config.
Pure Python (no torch, no numpy on the call path); see docs/cost-model.md."""

from .defaults import DEFAULTS, PROFILE_VERSION, default_profile
from .linear import LINEAR_TERMS, compile_linear, design_row
from .model import CostModel, load_cost_model
from .profile import (
    ProfileError,
    load_profile,
    merge_profile,
    resolve_profile,
    save_profile,
    validate_profile,
)
from .roofline import Roofline
from .terms import TERM_NAMES, active_terms

__all__ = [
    "DEFAULTS",
    "LINEAR_TERMS",
    "PROFILE_VERSION",
    "TERM_NAMES",
    "CostModel",
    "ProfileError",
    "Roofline",
    "active_terms",
    "compile_linear",
    "default_profile",
    "design_row",
    "load_cost_model",
    "load_profile",
    "merge_profile",
    "resolve_profile",
    "save_profile",
    "validate_profile",
]
