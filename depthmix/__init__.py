"""depthmix: depth-mixing transformers (Depth-Attention, MoDA, AttnRes, mHC, ...) on Megatron-Core."""

__version__ = "0.1.0"
