"""viasd: multi-tier speculative decoding (VIA-SD) for small machines."""

from viasd.api import GenerateConfig, generate
from viasd.decoding.registry import STRATEGIES
from viasd.decoding.stats import DecodeResult, DecodeStats
from viasd.errors import UsageError, ViasdError
from viasd.models import DEFAULT_MODEL, ZOO, LoadedModel, load_drafter, load_model
from viasd.version import __version__
__all__ = [
    "DEFAULT_MODEL",
    "STRATEGIES",
    "ZOO",
    "DecodeResult",
    "DecodeStats",
    "GenerateConfig",
    "LoadedModel",
    "UsageError",
    "ViasdError",
    "__version__",
    "generate",
    "load_drafter",
    "load_model",
]
