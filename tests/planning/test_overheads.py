"""``depthmix-overheads``: the Depth-Attention paper's Table 2 from the mixers' hooks, checked
against closed forms written here from each method's definition, at two presets. A mixer
without one here fails :func:`test_closed_forms`, asking for it."""

import pytest

from depthmix.config.load import compose_run
from depthmix.mixers import available, get_mixer
from depthmix.planning import flops as accounting
from depthmix.cli.overheads import main
from depthmix.planning.overheads import overheads

PREFILL, E = 131072, 2  # tokens, bytes per element

# preset -> (layers L, hidden d, KV width d_kv = H_kv * d_h)
PRESETS = {"3b": (48, 2048, 8 * 64), "500m": (24, 1152, 18 * 64)}


def depth_attn_io(L, d, dkv):
    """Anchored stride L/2: layers 1..L/2 read layer 0, the rest layers 0 and L/2; each reads
    n keys and n values and writes the mixed value: (2n + 1) d_kv."""
    s = L // 2
    return sum((2 * (1 if l <= s else 2) + 1) * dkv for l in range(1, L))


def attnres_block_io(L, d, blocks=8):
    """Sublayer at position p of block k reads k blocks (+ the partial sum when p > 0) and
    writes one aggregate; the head reads all blocks; partial-sum adds replace the residual
    adds, so N - blocks adds cancel and `blocks` residual adds are saved."""
    n = 2 * L
    m = n // blocks
    reads = sum((k + 1) + (k + 2) * (m - 1) for k in range(1, blocks + 1)) + (blocks + 2)
    return reads * d - 3 * d * blocks


CLOSED = {  # mixer -> (io elements per token, state elements per token)
    "vanilla": lambda L, d, dkv: (0, 0),
    "depth_attn": lambda L, d, dkv: (depth_attn_io(L, d, dkv), 0),
    "mhc": lambda L, d, dkv: (2 * L * (4 * 4 * d - d) + 2 * 5 * d, 3 * d),  # 4 streams
    "ddl": lambda L, d, dkv: (2 * L * (3 * d * 4 - 2 * d) + 2 * d * 5, 3 * d),  # d_v = 4
    "denseformer": lambda L, d, dkv: (d * L * (L + 5) // 2, L * d),
    "attnres_full": lambda L, d, dkv: (d * ((2 * L + 1) * (2 * L + 2) // 2 + 2 * L + 1)
                                       - 3 * d * 2 * L, 2 * L * d),
    "attnres_block": lambda L, d, dkv: (attnres_block_io(L, d), 8 * d),
    # reads 2l entries at layer l; writes the L - 1 read FFN projections; holds them all
    "moda": lambda L, d, dkv: (2 * dkv * (L * (L - 1) + L - 1), 2 * dkv * (L - 1)),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("mixer", available())
def test_closed_forms(preset, mixer):
    if mixer not in CLOSED:
        pytest.fail(f"mixer {mixer!r} has no closed form in CLOSED ({__file__}): write its "
                    "I/O and state elements per token from the method's definition")
    L, d, dkv = PRESETS[preset]
    run = compose_run(f"model={preset}", f"mixer={mixer}", "parallel.pp=4")
    got = overheads(run, get_mixer(mixer), PREFILL, E)
    io, state = CLOSED[mixer](L, d, dkv)
    assert got.io_bytes_per_token == io * E
    assert got.state_bytes == state * PREFILL * E
    # FLOPs and parameters are the training accounting's own numbers
    assert got.flops_per_token == accounting.flops_per_token(run, get_mixer(mixer))["mixer"]
    assert got.params == accounting.total_params(run, get_mixer(mixer)) - accounting.total_params(
        compose_run(f"model={preset}", "mixer=vanilla"), get_mixer("vanilla"))


def test_depth_attention_claims_at_3b():
    """The paper's claims: under 0.01% extra FLOPs, no extra persistent state; its pipeline
    boundary into layer 36 carries k_0, v_0, k_24, v_24 (4 x seq x d_kv)."""
    got = overheads(compose_run("model=3b", "mixer=depth_attn", "parallel.pp=4"),
                    get_mixer("depth_attn"), PREFILL, E)
    assert got.flops_share < 1e-4
    assert got.state_bytes == 0 and got.params == 0
    assert got.pipeline_bytes == 4 * 2048 * 512 * E


def _rows(out: str) -> list:
    return [line.split()[0] for line in out.splitlines()[2:]]


def test_cli_prints_every_mixer(capsys):
    assert main(["model=500m"]) == 0
    assert _rows(capsys.readouterr().out) == available()
    assert main(["model=500m", "--mixers", "vanilla,depth_attn,mhc"]) == 0
    assert _rows(capsys.readouterr().out) == ["vanilla", "depth_attn", "mhc"]
    assert main(["model=nope"]) == 2
