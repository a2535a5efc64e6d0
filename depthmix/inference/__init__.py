"""KV-cached generation that honours every depth mixer."""

from depthmix.inference.kv_cache import KVCache

__all__ = ["KVCache"]
