"""The pipeline transport's contract for every registered mixer, from the plan alone
(single process, no model): at each chunk's start the entries that arrive on the wire
and those the rank cached are exactly the live ones, disjoint; nothing is sent that the
receiving rank already holds; and packing, caching and unpacking real tensors through
``DepthTransport`` hands every chunk the current value of every live entry."""

import pytest
import torch

from depthmix.megatron_ext.config import to_transformer_config
from depthmix.planning.depth_plan import STEM
from depthmix.planning.pipeline import PipelineLayout, geometry_of
from depthmix.mixers import get_mixer
from depthmix.mixers.base import residual_plan
from depthmix.megatron_ext.transport import DepthStateCache, DepthTransport
from depthmix.testing import tiny_run, variant_cases

LAYERS = 8
CASES = [pytest.param(mixer, variant.options, id=test_id)
         for test_id, mixer, variant in variant_cases("transport")]
"""Each mixer's ``transport`` variants: options that give it real depth state at 8 layers."""
LAYOUTS = [pytest.param(pp, vp, tp, id=f"pp{pp}xvp{vp}" + ("-tp2sp" if tp > 1 else ""))
           for pp, vp, tp in [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2)]]


def geometry(mixer, options, pp, vp, tp):
    run = tiny_run(mixer, **options)
    run.model.num_layers = LAYERS
    run.mixer.resolve(run.model)
    run.parallel.tp, run.parallel.sequence_parallel = tp, tp > 1
    return geometry_of(get_mixer(mixer).plan, to_transformer_config(run),
                       PipelineLayout(LAYERS, pp, vp), tp)


def names(entries):
    return {e.name for e in entries}


@pytest.mark.parametrize("mixer,options", CASES)
def test_options_give_depth_state(mixer, options):
    """Only a mixer whose plan is the plain residual stream (vanilla) has no other entry."""
    plan = geometry(mixer, options, 1, 1, 1).plan
    assert (set(plan.entries) == {"h"}) == (get_mixer(mixer).plan is residual_plan)


@pytest.mark.parametrize("pp,vp,tp", LAYOUTS)
@pytest.mark.parametrize("mixer,options", CASES)
def test_sent_and_cached_split_the_live_state(mixer, options, pp, vp, tp):
    """Replays the pipeline in chunk order with (entry, version) pairs: what a rank holds
    is everything it received, cached or wrote; a version is the layer that wrote it."""
    geo = geometry(mixer, options, pp, vp, tp)
    layout, plan = geo.layout, geo.plan
    seen = {r: set() for r in range(pp)}  # (name, version) pairs each rank has had
    for chunk in range(layout.num_chunks):
        rank, start = layout.rank_of(chunk), layout.start(chunk)
        live = {(e.name, e.version_at(start)) for e in plan.live_at(start)}
        if chunk == 0:
            assert {v for _, v in live} <= {STEM}
            received = live
        else:
            sent = {(e.name, e.version_at(start)) for e in geo.sent_into(chunk)}
            prev = chunk - pp
            cached = ({(e.name, e.version_at(start)) for e in geo.cached_after(prev)}
                      if prev >= 0 else set())
            assert sent | cached == live, f"chunk {chunk}: sent + cached is not the live state"
            assert not sent & cached, f"chunk {chunk}: sent and cached overlap"
            assert not sent & seen[rank], f"chunk {chunk}: sends what the receiver holds"
            assert cached <= seen[rank], f"chunk {chunk}: a cached value the rank never had"
            received = sent | cached
        seen[rank] |= received
        for layer in layout.layers(chunk):
            seen[rank] |= {(e.name, layer) for e in plan.entries.values() if layer in e.writers}
        assert names(geo.cached_after(chunk)) <= names(plan.live_at(layout.end(chunk)))


@pytest.mark.parametrize("pp,vp,tp", LAYOUTS)
@pytest.mark.parametrize("mixer,options", CASES)
def test_packed_wire_carries_the_live_state(mixer, options, pp, vp, tp):
    """Real tensors through ``DepthTransport`` (one cache per rank, two micro-batches):
    every chunk receives the current value of every live entry, and the packed tensor has
    the wire shape and the payload's bytes."""
    geo = geometry(mixer, options, pp, vp, tp)
    layout, plan, b, hidden = geo.layout, geo.plan, 2, geo.hidden_size
    caches = [DepthStateCache() for _ in range(pp)]
    transports = [DepthTransport(geo, c, caches[layout.rank_of(c)])
                  for c in range(layout.num_chunks)]
    g = torch.Generator().manual_seed(0)

    def value(entry):
        return torch.randn(geo.seq_of(entry), b, *entry.shape, generator=g)

    with torch.no_grad():
        for micro in range(2):
            truth = {e.name: value(e) for e in plan.live_at(0)}  # the stem's outputs
            packed = None
            for chunk in range(layout.num_chunks):
                start = layout.start(chunk)
                if chunk > 0:
                    assert packed.shape == (geo.wire_rows(chunk), b, hidden)
                    state = transports[chunk].receive(packed, micro)
                    assert set(state) == names(plan.live_at(start))
                    for name, tensor in state.items():
                        assert torch.equal(tensor, truth[name]), f"chunk {chunk}: {name}"
                for layer in layout.layers(chunk):  # the chunk's layers write new versions
                    truth.update({e.name: value(e) for e in plan.entries.values()
                                  if layer in e.writers})
                if chunk + 1 < layout.num_chunks:
                    end_live = names(plan.live_at(layout.end(chunk)))
                    sent_before = transports[chunk].bytes_sent
                    packed = transports[chunk].send({n: truth[n] for n in end_live}, micro)
                    assert transports[chunk].bytes_sent - sent_before == \
                        geo.payload_bytes(chunk + 1, b, packed.element_size())


def test_the_model_resets_its_depth_cache(megatron_single):
    """``step.py`` clears the rank's cache through the model, before and after a pass."""
    from depthmix.testing import build_model

    model = build_model(tiny_run("attnres_full"))
    model.transport.cache.put(0, "y0", torch.zeros(1))
    assert len(model.transport.cache) == 1
    model.reset_depth_cache()
    assert len(model.transport.cache) == 0
