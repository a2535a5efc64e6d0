"""Megatron-Core extensions: the depth-mixing decoder, its layer specs and pipeline transport."""
