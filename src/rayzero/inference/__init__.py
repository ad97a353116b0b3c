"""The central inference role (dynamic batching, latent pool, weight swaps)."""

from rayzero.inference.server import InferenceError, InferenceServer, LatentPool, bucket_ladder

__all__ = ["InferenceError", "InferenceServer", "LatentPool", "bucket_ladder"]
