"""Models: the zoo, loading from any source, and the lean routed runtime."""

from viasd.models.loading import LoadedModel, cache_dir, load_drafter, load_model
from viasd.models.config import ModelConfig
from viasd.models.decoder import Decoder
from viasd.models.kvcache import KVCache, LayerMask
from viasd.models.zoo import DEFAULT_MODEL, ZOO

__all__ = ["DEFAULT_MODEL", "ZOO", "Decoder", "KVCache", "LayerMask", "LoadedModel", "ModelConfig", "cache_dir", "load_drafter",
           "load_model"]
