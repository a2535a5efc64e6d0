"""KV-cached generation that honours every depth mixer."""

__all__ = ["KVCache"]


def __getattr__(name):
    # Lazy: `depthmix-generate --help` imports this package and must not wait for torch.
    if name == "KVCache":
        from depthmix.inference.kv_cache import KVCache

        return KVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
