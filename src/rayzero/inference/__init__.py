"""The central inference role: dynamic batching, CUDA-graph buckets, latent pool, cache, whole searches."""

from rayzero.inference.cache import EvalCache
from rayzero.inference.errors import InferenceError, InferenceOverloaded
from rayzero.inference.pool import LatentPool
from rayzero.inference.server import InferenceServer, bucket_ladder

__all__ = ["EvalCache", "InferenceError", "InferenceOverloaded", "InferenceServer", "LatentPool", "bucket_ladder"]
