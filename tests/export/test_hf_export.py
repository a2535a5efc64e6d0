"""depthmix-export: checkpoints (any layout) -> transformers models whose logits equal ours."""

import json
import os

import pytest
import torch

from depthmix.checkpoint.record import record
from depthmix.data.tokenizer import HFTokenizer, train_bpe_tokenizer
from depthmix.cli.export import main as export_main
from depthmix.inference.generate import generate
from depthmix.inference.load import load_model
from depthmix.testing import spawn, tiny_run, train_and_save

VOCAB = 300  # real vocabulary; the embedding is padded to 320 (384 at TP2)
TEXTS = ["the quick brown fox jumps over the lazy dog", "depth mixing reads earlier layers",
         "attention over depth and over the sequence", "a tiny model for a tiny test"] * 8


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_bpe_tokenizer(TEXTS, VOCAB - 10, path)
    return path


def make_run(mixer="vanilla", tp=1, **options):
    run = tiny_run(mixer, **options)
    run.model.vocab_size = VOCAB
    t = run.train
    t.micro_batch_size, t.global_batch_size, t.steps, t.lr = 2, 2 * tp, 1, 3e-2
    t.eval_interval, t.log_interval = 0, 1
    run.logger.wandb, run.logger.mode, run.logger.progress = False, "disabled", False
    run.parallel.tp = tp
    return run


def ours_and_hf(ckpt_dir, out_dir, **hf_kwargs):
    from transformers import AutoModelForCausalLM

    assert export_main([ckpt_dir, out_dir]) == 0
    ours = load_model(ckpt_dir)
    hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, **hf_kwargs).eval()
    return ours, hf


def assert_same_logits(ours, hf):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.model(ids)[..., :VOCAB]
        got = hf(ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    return ids


@pytest.fixture(scope="module")
def vanilla_export(megatron_single, tokenizer_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("vanilla")
    ckpt_dir = train_and_save(make_run(), str(root / "ckpt"), tokenizer_file)
    return ckpt_dir, str(root / "hf_vanilla")


def test_vanilla_loads_without_custom_code_and_matches(vanilla_export, tokenizer_file):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    ckpt_dir, out = vanilla_export
    ours, hf = ours_and_hf(ckpt_dir, out)
    assert type(hf) is Qwen3ForCausalLM
    ids = assert_same_logits(ours, hf)

    # greedy decoding: HF's generate with its cache == ours with our KV cache
    prompt = ids[:, :5]
    mine = generate(ours.model, prompt, max_new_tokens=6, vocab_size=VOCAB)
    theirs = hf.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(theirs, mine)

    tok = AutoTokenizer.from_pretrained(out)
    text = "the lazy fox reads depth"
    assert tok(text)["input_ids"] == HFTokenizer(tokenizer_file).encode(text)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 0, 1)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is False
    assert "auto_map" not in config


WORD_BOUNDARY = [("the quick brown f", "ox jumps over"), ("depth mixing re", "ads earlier"),
                 ("attention over dep", "th and over"), ("over the seq", "uence"),
                 ("the quick brown fox jumps over the l", "azy dog")]
"""Requests split inside a word that this tokenizer encodes differently alone and in the
whole text (``"...dep"`` -> ``de``, ``p``; ``"...depth and"`` -> ``depth``, ...): lm-eval
conditions the continuation on the context's own tokens."""
MERGED = ("the quick brown fox jumps o", "ver")
"""The whole text ends in one token `` over``: lm-eval's continuation is empty."""


def _instances(requests):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i)
            for i, r in enumerate(requests)]


def test_lm_evals_hf_model_scores_the_export_as_our_adapter_does(vanilla_export, monkeypatch):
    """``pip install -e '.[dev]'`` brings lm-eval's own ``hf`` model (accelerate): offline,
    on the exported directory, its log-likelihoods are our adapter's on the checkpoint,
    also for words split at the context's end; where lm-eval's split leaves no continuation
    (its ``hf`` model asserts) ours scores the whole text's last token."""
    from lm_eval.models.huggingface import HFLM

    from depthmix.evaluate.harness import DepthmixLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt_dir, out = vanilla_export
    if not os.path.exists(os.path.join(out, "config.json")):
        assert export_main([ckpt_dir, out]) == 0
    hflm = HFLM(pretrained=out, device="cpu", dtype="float32", batch_size=2)
    for context, continuation in WORD_BOUNDARY:  # the case arises with this tokenizer
        alone, whole = hflm.tok_encode(context), hflm.tok_encode(context + continuation)
        assert whole[:len(alone)] != alone and len(whole) > len(alone), context
    assert hflm._encode_pair(*MERGED)[1] == []
    requests = [("the quick brown", " fox jumps over"), ("depth mixing", " reads earlier"),
                ("a tiny model for", " a tiny test"), ("depth mixing reads ", "earlier layers"),
                *WORD_BOUNDARY]
    theirs = hflm.loglikelihood(_instances(requests), disable_tqdm=True)
    ours = DepthmixLM(model=load_model(ckpt_dir), batch_size=2).loglikelihood(
        _instances([*requests, MERGED]), disable_tqdm=True)
    gaps = [abs(a - b) for (a, _), (b, _) in zip(theirs, ours)]
    for request, (a, a_greedy), (b, b_greedy) in zip(requests, theirs, ours):
        assert abs(a - b) < 1e-4 and a_greedy == b_greedy, (request, a, b)
    print(f"max |loglikelihood difference| over {len(requests)} requests: {max(gaps):.2e}")
    whole = hflm.tok_encode("".join(MERGED))  # its last token after (up to) 16 before it
    with torch.no_grad():
        logits = hflm.model(torch.tensor([whole[-17:-1]])).logits[0, -1].float()
    assert abs(ours[-1][0] - float(torch.log_softmax(logits, -1)[whole[-1]])) < 1e-4


@pytest.mark.parametrize("options", [{}, {"stride": 1, "source_mode": "relative"},
                                     {"stride": 3, "mix_rule": "uniform"}],
                         ids=["default-stride", "stride1-relative", "stride3-uniform"])
def test_depth_attn_through_remote_code_matches(megatron_single, tokenizer_file, tmp_path,
                                                options):
    ckpt_dir = train_and_save(make_run("depth_attn", **options), str(tmp_path / "ckpt"),
                              tokenizer_file)
    out = str(tmp_path / f"hf_depth_attn_{'_'.join(map(str, options.values())) or 'default'}")
    ours, hf = ours_and_hf(ckpt_dir, out, trust_remote_code=True)
    assert type(hf).__name__ == "DepthMixQwen3ForCausalLM"
    ids = assert_same_logits(ours, hf)
    prompt = ids[:1, :4]
    mine = generate(ours.model, prompt, max_new_tokens=4, vocab_size=VOCAB)
    assert torch.equal(hf.generate(prompt, max_new_tokens=4, do_sample=False,
                                   min_new_tokens=4), mine)


def test_depth_attn_export_needs_trust_remote_code(megatron_single, tokenizer_file, tmp_path,
                                                   monkeypatch):
    """Without remote code the directory must not load as a plain Qwen3 (silently wrong);
    its tokenizer loads as docs/evaluation.md shows, without the "custom code [y/N]"
    question (``input`` fails the test if asked)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    ckpt_dir = train_and_save(make_run("depth_attn"), str(tmp_path / "ckpt"), tokenizer_file)
    out = str(tmp_path / "hf_depth_attn_plain")
    assert export_main([ckpt_dir, out]) == 0
    with pytest.raises(Exception, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)

    def asked(prompt=""):
        raise AssertionError(f"prompted: {prompt}")

    monkeypatch.setattr("builtins.input", asked)
    ours = HFTokenizer(tokenizer_file).encode("depth mixing reads")
    for tok in (PreTrainedTokenizerFast.from_pretrained(out),
                AutoTokenizer.from_pretrained(out, trust_remote_code=True)):
        assert tok("depth mixing reads")["input_ids"] == ours


@pytest.mark.parametrize("mixer,options,message", [
    ("mhc", {}, "mixer=mhc"),
    ("attnres_block", {"block_size": 4}, "mixer=attnres_block"),
    ("depth_attn", {"mixed_state": "key"}, "mixer.mixed_state=key"),
])
def test_other_mixers_are_refused_before_loading(tmp_path, capsys, mixer, options, message):
    """A checkpoint whose record names another mixer: exit 2, one line naming it, nothing
    written (only the record is read: the directory holds no weights at all)."""
    ckpt_dir = tmp_path / "iter_0000001"
    ckpt_dir.mkdir()
    meta = {"format_version": 1, "step": 1, "record": record(tiny_run(mixer, **options))}
    (ckpt_dir / "depthmix.json").write_text(json.dumps(meta))
    out = tmp_path / "hf"
    assert export_main([str(ckpt_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


ROUTERS = {
    # Switch / GShard / Qwen3-MoE: softmax top-2, renormalised; experts after the first layer
    "softmax": dict(num_experts=4, top_k=2, ffn_hidden_size=48, first_dense_layers=1),
    # DeepSeek-V3 / Kimi K2: sigmoid top-3 chosen with the expert bias (moved 0.05 by the one
    # training step, so it decides choices), scaled by 2.5, a shared expert; every 2nd layer
    "sigmoid_bias_shared": dict(num_experts=8, top_k=3, ffn_hidden_size=32,
                                shared_expert_ffn_hidden_size=40, layer_freq=2,
                                score_function="sigmoid", expert_bias=True,
                                expert_bias_update_rate=0.05, routed_scaling_factor=2.5,
                                aux_loss_coeff=0.0),
    # trained with a capacity (tokens dropped); exported, as loaded, dropless
    "softmax_capacity": dict(num_experts=4, top_k=2, ffn_hidden_size=48, dropless=False,
                             capacity_factor=1.0),
}
EXPERT_CASES = [pytest.param(mixer, router, id=f"{mixer}-{router}",
                             marks=() if mixer == "depth_attn" and router != "softmax_capacity"
                             else pytest.mark.full)
                for mixer in ("depth_attn", "vanilla") for router in ROUTERS]


def _wrong_routing(hf) -> None:
    """What a modeling file that routed wrongly would compute: the expert bias left out of
    the choice, or the top-k weights renormalised the other way."""
    for module in hf.modules():
        if hasattr(module, "e_score_correction_bias"):  # ours
            if module.e_score_correction_bias is not None:
                module.e_score_correction_bias.zero_()
            else:
                module.normalize = not module.normalize
        elif hasattr(module, "norm_topk_prob"):  # Qwen3MoeTopKRouter
            module.norm_topk_prob = not module.norm_topk_prob


@pytest.mark.parametrize("mixer,router", EXPERT_CASES)
def test_experts_export_with_our_routing(megatron_single, tokenizer_file, tmp_path, mixer,
                                         router):
    """Experts under a depth mixer (remote code) or the plain residual (Qwen3-MoE without
    custom code when its router is Qwen3-MoE's): logits and greedy generation are ours, and
    a wrong routing would not be."""
    from depthmix.config.schema import MoEConfig

    run = make_run(mixer)
    run.model.moe = MoEConfig(**ROUTERS[router])
    ckpt_dir = train_and_save(run, str(tmp_path / "ckpt"), tokenizer_file)
    ours, hf = ours_and_hf(ckpt_dir, str(tmp_path / "hf"), trust_remote_code=True)
    plain = mixer == "vanilla" and router != "sigmoid_bias_shared"
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if plain else "DepthMixQwen3ForCausalLM")
    if router == "sigmoid_bias_shared":
        bias = [b for n, b in ours.model.named_buffers() if n.endswith("router.expert_bias")]
        assert len(bias) == 2 and all(b.abs().max() > 0.04 for b in bias)
    ids = assert_same_logits(ours, hf)
    prompt = ids[:, :5]
    mine = generate(ours.model, prompt, max_new_tokens=6, vocab_size=VOCAB)
    assert torch.equal(hf.generate(prompt, max_new_tokens=6, do_sample=False,
                                   min_new_tokens=6), mine)
    with torch.no_grad():
        _wrong_routing(hf)
        assert (hf(ids).logits - ours.model(ids)[..., :VOCAB]).abs().max() > 1e-2


def test_experts_without_qk_norm_are_refused(tmp_path, capsys):
    """Exported as Llama, which has no experts."""
    from depthmix.config.schema import MoEConfig

    run = tiny_run("vanilla")
    run.model.qk_layernorm = False
    run.model.moe = MoEConfig(**ROUTERS["softmax"])
    ckpt_dir = tmp_path / "iter_0000001"
    ckpt_dir.mkdir()
    meta = {"format_version": 1, "step": 1, "record": record(run)}
    (ckpt_dir / "depthmix.json").write_text(json.dumps(meta))
    assert export_main([str(ckpt_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.qk_layernorm=false with experts" in err and len(err.strip().splitlines()) == 1


def _train_tp2(root, tokenizer):
    return train_and_save(make_run(tp=2), root, tokenizer)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_checkpoint_saved_at_tp2_exports_the_same_model(megatron_single, tokenizer_file,
                                                        tmp_path):
    root = str(tmp_path / "ckpt_tp2")
    spawn(_train_tp2, 2, (root, tokenizer_file), timeout=240)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"
    ours, hf = ours_and_hf(root, str(tmp_path / "hf_tp2"))
    assert ours.meta["layout"]["tp"] == 2
    assert_same_logits(ours, hf)
