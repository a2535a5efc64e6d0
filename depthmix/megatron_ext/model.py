"""The depth-mixing decoder: embedding stem -> layers on a depth state -> head.

One ``DepthMixModel`` is one pipeline chunk (Megatron's convention): the first chunk
embeds tokens and builds the initial depth state, middle chunks receive it through the
pipeline transport, the last chunk reads the final hidden state and computes the loss.
It is built from what its mixer hands it (Megatron's layer spec): the model spec and the
depth plan; :func:`build_chunk` takes both, and the bind hook, from a ``Mixer``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import Tensor

from depthmix.megatron_ext.context import ForwardContext
from depthmix.megatron_ext.loss import OutputLayer
from depthmix.planning.depth_plan import DepthPlan, DepthState
from depthmix.megatron_ext.layer import HIDDEN
from depthmix.planning.pipeline import PipelineLayout, geometry_of
from depthmix.megatron_ext.transport import DepthStateCache, DepthTransport


@contextlib.contextmanager
def seeded_init(seed: int):
    """Draw initial weights from a fixed seed, restoring the RNG afterwards.

    With ``use_cpu_initialization`` Megatron initialises each full weight on the CPU and
    keeps this rank's shard, so seeding per layer makes the model identical at every
    TP/PP layout.
    """
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


class StateStem(MegatronModule):
    """Embedding output -> initial depth state (vanilla: the residual stream)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)

    def forward(self, embeddings: Tensor) -> DepthState:
        return {HIDDEN: embeddings}


class StateHead(MegatronModule):
    """Final depth state -> the hidden state the final norm reads (vanilla: ``h``)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)

    def forward(self, state: DepthState, ctx: ForwardContext) -> Tensor:
        return state[HIDDEN]


@dataclass
class DepthMixModelSubmodules:
    layer: Union[ModuleSpec, type, Tuple[ModuleSpec, ...]]
    """Every layer's spec, or one per (unique, global) layer (dense and MoE layers)."""
    stem: Union[ModuleSpec, type] = StateStem
    head: Union[ModuleSpec, type] = StateHead
    final_layernorm: Union[ModuleSpec, type, None] = None


class DepthMixBlock(MegatronModule):
    """The layers of one pipeline chunk, run over the depth state."""

    def __init__(self, config, layer_spec, layer_indices: range, plan: DepthPlan,
                 pg_collection=None):
        super().__init__(config=config)
        self.plan = plan
        self.layer_indices = layer_indices
        layers = []
        for i in layer_indices:
            spec = layer_spec[i] if isinstance(layer_spec, tuple) else layer_spec
            with seeded_init(config.init_seed + 1000 * (i + 1)):
                layers.append(build_module(spec, config=config, layer_number=i + 1,
                                           pg_collection=pg_collection))
        self.layers = torch.nn.ModuleList(layers)

    @property
    def current_microbatch(self) -> int:
        # Megatron's schedules set ``current_microbatch`` on ``model.decoder.layers``.
        return getattr(self.layers[0], "current_microbatch", 0) or 0

    def unrolled(self):
        """(unrolled index, layer module) in execution order; loops share the modules."""
        n = self.config.num_layers
        for loop in range(self.config.n_loops):
            for idx, layer in zip(self.layer_indices, self.layers):
                yield loop * n + idx, layer

    def forward(self, state: DepthState, ctx: ForwardContext) -> DepthState:
        recompute = self.config.recompute_granularity == "full" and torch.is_grad_enabled()
        for u, layer in self.unrolled():
            ctx.layer = u
            state = _checkpointed(layer, state, ctx) if recompute else layer(state, ctx)
            live = self.plan.live_names(u + 1)
            missing = live - state.keys()
            assert not missing, f"layer {u} dropped live depth-state entries {sorted(missing)}"
            state = {k: v for k, v in state.items() if k in live}
        return state

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint keys use the global layer index, so any PP layout can load them."""
        out = {}
        for idx, layer in zip(self.layer_indices, self.layers):
            local = f"{prefix}layers.{idx - self.layer_indices.start}."
            layer_sd = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_sd, local, f"{prefix}layers.{idx}.")
            out.update(layer_sd)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.",
                                                      sharded_offsets, metadata))
        return out


def _checkpointed(layer, state: DepthState, ctx: ForwardContext) -> DepthState:
    """Full activation recomputation of one layer over a dict-valued depth state.

    Megatron's ``CheckpointFunction`` takes and returns flat tensors: the layer's inputs
    are the state's tensors, its outputs the entries it wrote.
    """
    names = list(state)
    written = []
    unrolled = ctx.layer

    def run(*tensors):
        ctx.layer = unrolled
        new = layer(dict(zip(names, tensors)), ctx)
        changed = [k for k in new if k not in names or new[k] is not tensors[names.index(k)]]
        written[:] = changed
        return tuple(new[k] for k in changed)

    outputs = tensor_parallel.checkpoint(run, False, *[state[k] for k in names])
    if isinstance(outputs, Tensor):
        outputs = (outputs,)
    new_state = dict(state)
    new_state.update(zip(written, outputs))
    return new_state


class DepthMixModel(LanguageModule):
    """Qwen3-style decoder with a depth state; one pipeline chunk of it.

    Args:
        config: :class:`~depthmix.megatron_ext.config.DepthMixConfig`.
        submodules: the mixer's model spec (``Mixer.model_spec(config)``).
        plan: the mixer's depth plan, ``(config, tp) -> [Entry]`` (``Mixer.plan``).
        pre_process / post_process: whether this chunk embeds / computes the loss.
        vp_stage: virtual pipeline stage of this chunk (None without interleaving).
        cache: per-rank depth-state cache shared by this rank's chunks.
    """

    def __init__(self, config, submodules: DepthMixModelSubmodules, plan: Callable,
                 pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, cache: Optional[DepthStateCache] = None,
                 pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.vp_stage = vp_stage
        self.share_embeddings_and_output_weights = config.tie_embeddings
        self.vocab_size = config.vocab_size
        self.max_sequence_length = config.seq_length
        self.position_embedding_type = "rope"

        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp = config.virtual_pipeline_model_parallel_size or 1
        self.layout = PipelineLayout(config.num_layers, pp, vp)
        self.chunk = self.layout.chunk(pp_rank, vp_stage or 0)
        self.geometry = geometry_of(plan, config, self.layout, tp)
        self.plan = self.geometry.plan
        if cache is None:  # not ``cache or ...``: an empty cache has len() 0
            cache = DepthStateCache()
        self.transport = DepthTransport(self.geometry, self.chunk, cache)

        seed = config.init_seed
        if pre_process:
            with seeded_init(seed):
                self.embedding = LanguageModelEmbedding(
                    config=config, vocab_size=self.vocab_size,
                    max_sequence_length=config.seq_length, position_embedding_type="rope",
                    tp_group=self.tp_group,
                )
            self.stem = build_module(submodules.stem, config=config)
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0,
            rotary_base=config.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
        self.decoder = DepthMixBlock(config, submodules.layer, self.layout.layers(self.chunk),
                                     self.plan, pg_collection=pg_collection)
        if post_process:
            self.head = build_module(submodules.head, config=config)
            self.final_layernorm = build_module(
                submodules.final_layernorm, config=config, hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
            with seeded_init(seed + 1):
                # tied on one stage: no weight of its own; tied across stages: a copy that
                # setup_embeddings_and_output_layer fills from the first stage's embedding
                self.output_layer = OutputLayer(
                    config.hidden_size, self.vocab_size, config=config,
                    init_method=config.init_method, bias=False, skip_bias_add=False,
                    gather_output=False, tp_group=self.tp_group,
                    skip_weight_param_allocation=pre_process and config.tie_embeddings,
                )
        if pre_process or post_process:
            # Megatron's shared embedding/output weights: at PP > 1 the copy is synchronised
            # over the embedding group here, and its gradient in finalize_model_grads
            self.setup_embeddings_and_output_layer()
        self.input_tensor = None

    def reset_depth_cache(self) -> None:
        """Drop the depth state this rank cached for its later chunks (one cache shared
        by the rank's chunks): before and after every forward-backward pass."""
        self.transport.cache.reset()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, inference=None,
                stats: Optional[dict] = None, **kwargs):
        """``input_ids [b, s]`` -> per-token loss ``[b, s]`` (with ``labels``), logits
        ``[b, s, vocab/tp]`` (last chunk, no labels), or the packed state (other chunks)."""
        microbatch = self.decoder.current_microbatch
        seq_len = input_ids.shape[1] if input_ids is not None else self.config.seq_length
        offset = inference.offset if inference is not None else 0
        rows = inference.positions(seq_len) if inference is not None else None
        if rows is None:
            rotary = self.rotary_pos_emb(offset + seq_len)[offset:]  # [s, 1, 1, d]
        else:  # left-padded batch: each row's own positions, [s, b, 1, d]
            rotary = self.rotary_pos_emb(offset + seq_len)[rows.t(), 0]
            position_ids = rows
        ctx = ForwardContext(rotary_pos_emb=rotary, inference=inference, stats=stats)
        if self.pre_process:
            if position_ids is None:
                position_ids = torch.arange(offset, offset + seq_len, device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
            embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids)
            # at micro-batch 1 Megatron's [s, b, h] is a transposed view with batch stride
            # s * h; a compiled first layer would guard on it and compile a body of its own
            state = self.stem(embeddings.view(embeddings.shape))
        else:
            state = self.transport.receive(self.input_tensor, microbatch)

        state = self.decoder(state, ctx)

        if not self.post_process:
            return self.transport.send(state, microbatch)
        hidden = self.final_layernorm(self.head(state, ctx))
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        if labels is not None and self.config.fused_cross_entropy:  # no full logits
            loss, _ = self.output_layer(hidden, weight=weight, labels=labels)  # [b, s]
            return loss
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, vocab/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)  # [b, s]


def build_chunk(config, mixer, **chunk) -> DepthMixModel:
    """One chunk of the model of ``mixer`` (a :class:`~depthmix.mixers.base.Mixer`, handed
    down by the caller): built from its model spec and plan, then given to its ``bind``
    hook. ``chunk``: :class:`DepthMixModel`'s other arguments."""
    model = DepthMixModel(config, mixer.model_spec(config), mixer.plan, **chunk)
    if mixer.bind is not None:
        mixer.bind(model)
    return model


def unwrap(module) -> DepthMixModel:
    """The ``DepthMixModel`` inside DDP / Float16Module wrappers."""
    while not isinstance(module, DepthMixModel):
        module = module.module
    return module
