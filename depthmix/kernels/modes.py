"""The option values the kernels take, without torch: the mixers offer them as their
options' choices (``MixerConfig.CHOICES``) and the kernels check them, from this one list."""

IMPLS = ("auto", "torch", "triton")
"""``mixer.impl`` as requested; :func:`depthmix.kernels.dispatch.resolve_impl` turns it into
``torch`` or ``triton`` once, at start-up."""

MIX_RULES = ("softmax", "uniform")
"""``depth_mix``: softmax weights over the sources' scores, or uniform ones."""

MIXED_STATES = ("value", "key", "key_value")
"""``depth_mix``: what the depth step mixes (the layer's value, key or both)."""

MHC_VARIANTS = ("mhc", "hc", "identity")
"""``mhc``: Sinkhorn-constrained ``H_res`` (mHC), unconstrained tanh coefficients (the
original Hyper-Connections), or ``H_res = I``."""
