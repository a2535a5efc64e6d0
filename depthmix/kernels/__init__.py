"""Fused Triton kernels with plain-PyTorch references (kernels/<op>/)."""
