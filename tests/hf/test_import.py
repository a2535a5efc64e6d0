"""depthmix-import on one process: Hugging Face Qwen3 / Llama / tied-embedding / Qwen3-MoE
models (built here from random weights) become checkpoints whose logits, greedy generation
and ``depthmix-eval`` loss are transformers'; import -> export gives the original tensors bit
for bit and loads as the original class with its logits; what does not map is refused at
once, naming the field. The import's output directory is itself the checkpoint every
command takes (here: its own path, not its ``checkpoints/``). (The other layouts:
``test_import_layouts.py``.)"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from hf_models import (
    KINDS, MOE, MOE_KINDS, SEQ, VOCAB, checkpoints, hf_model, hf_window_loss,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf(hf_dirs):
    """kind -> the transformers model, loaded from its folder (fp32)."""
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for k, p in hf_dirs.items()}


@pytest.fixture(scope="module")
def ours(imported, megatron_single):
    from depthmix.inference.load import load_model

    return {k: load_model(out) for k, out in imported.items()}


def ids(batch=2, length=SEQ, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(kind, ours, hf):
    x = ids()
    with torch.no_grad():
        mine, theirs = ours[kind].model(x), hf[kind](x).logits
    assert mine.shape == theirs.shape == (2, SEQ, VOCAB)  # nothing padded
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    assert theirs.std() > 1  # logits that differ between tokens, not a constant


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_is_identical(kind, ours, hf):
    from depthmix.inference.generate import generate

    prompt = ids(2, 5, seed=1)
    mine = generate(ours[kind].model, prompt, max_new_tokens=8, vocab_size=VOCAB)
    theirs = hf[kind].generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_loss_equals_transformers_over_the_same_windows(kind, imported, hf, dataset,
                                                             tmp_path, megatron_single):
    from depthmix.evaluate.job import compose_job, run_job

    job = compose_job(f"eval.checkpoint={imported[kind]}",
                      f"eval.datasets={{d: {dataset}}}", "eval.batch_size=4",
                      f"eval.output={tmp_path}/eval.json", "logger=none")
    result = run_job(job)["datasets"]["d"]
    loss, tokens = hf_window_loss(hf[kind], dataset)
    assert result["tokens"] == tokens == 199
    assert result["loss"] == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_import_then_export_gives_the_original_tensors(kind, imported, hf_dirs, hf, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from depthmix.cli.export import main as export

    assert export([imported[kind], str(tmp_path / "hf")]) == 0
    original = load_file(os.path.join(hf_dirs[kind], "model.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.load(open(tmp_path / "hf" / "config.json"))
    source = json.load(open(os.path.join(hf_dirs[kind], "config.json")))
    assert config["model_type"] == source["model_type"]
    assert config["tie_word_embeddings"] is kind.endswith("_tied")
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert type(again) is type(hf[kind])  # e.g. Qwen3MoeForCausalLM, no custom code
    x = ids()
    with torch.no_grad():
        assert torch.equal(again.eval()(x).logits, hf[kind](x).logits)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_experts_map_onto_the_layers_and_routers_of_model_moe(kind, imported, hf_dirs):
    """The preset's ``model.moe`` places the experts where Qwen3-MoE has them and routes as
    its config says."""
    from depthmix.checkpoint.store import find_checkpoint, read_meta

    source = json.load(open(os.path.join(hf_dirs[kind], "config.json")))
    moe = read_meta(find_checkpoint(checkpoints(imported[kind])))["record"]["model"]["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["ffn_hidden_size"]) == (
        MOE[kind]["num_experts"], MOE[kind]["num_experts_per_tok"],
        MOE[kind]["moe_intermediate_size"])
    assert moe["normalize_top_k"] is MOE[kind]["norm_topk_prob"]
    assert (moe["score_function"], moe["shared_expert_ffn_hidden_size"]) == ("softmax", 0)
    assert moe["aux_loss_coeff"] == source["router_aux_loss_coef"] == 0.01
    hf_layers = [i for i, layer in enumerate(hf_model(kind).model.layers)
                 if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
    ours = [i for i in range(4) if (i - moe["first_dense_layers"]) >= 0
            and (i - moe["first_dense_layers"]) % moe["layer_freq"] == 0]
    assert ours == hf_layers == ([1, 3] if kind == "qwen3_moe" else [1, 2, 3])


def test_packed_experts_import_as_the_per_expert_file(imported, hf_dirs, tmp_path,
                                                      megatron_single):
    """A file holding each layer's experts as 3-D tensors (``mlp.experts.gate_up_proj
    [E, 2f, d]``, ``down_proj [E, d, f]``, transformers 5's module layout) imports to the
    same weights."""
    from safetensors.torch import load_file, save_file

    from depthmix.cli.importer import main
    from depthmix.inference.load import load_model

    source = tmp_path / "packed"
    source.mkdir()
    for name in ("config.json", "tokenizer.json"):
        os.symlink(os.path.join(hf_dirs["qwen3_moe"], name), source / name)
    weights = load_file(os.path.join(hf_dirs["qwen3_moe"], "model.safetensors"))
    for layer in (1, 3):
        pre = f"model.layers.{layer}.mlp.experts."
        per = [{p: weights.pop(f"{pre}{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
               for e in range(4)]
        weights[pre + "gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]])
                                                     for w in per])
        weights[pre + "down_proj"] = torch.stack([w["down"] for w in per])
    save_file(weights, str(source / "model.safetensors"))
    assert main([str(source), str(tmp_path / "out"), "--seq-length", str(SEQ)]) == 0
    packed = load_model(str(tmp_path / "out")).model.state_dict()
    per_expert = load_model(imported["qwen3_moe"]).model.state_dict()
    weights = [k for k in per_expert if not k.endswith("_extra_state")]
    assert any("local_experts.3.linear_fc1" in k for k in weights)
    for key in weights:
        assert torch.equal(packed[key], per_expert[key]), key


def test_the_output_is_a_checkpoint_a_preset_and_the_tokenizer(imported, hf_dirs, tmp_path):
    """The record, health mark and preset describe the model; the preset composes into the
    record's model, and the training preflight takes the import with a new mixer."""
    from depthmix.checkpoint.store import find_checkpoint, read_meta
    from depthmix.config.load import compose_run
    from depthmix.data.tokenizer import HFTokenizer
    from depthmix.pretrain.preflight import preflight

    out = imported["qwen3_tied"]
    meta = read_meta(find_checkpoint(checkpoints(out)))
    model = meta["record"]["model"]
    assert (model["tie_embeddings"], model["qk_layernorm"], model["head_dim"]) == (True, True, 16)
    assert (model["rotary_base"], model["seq_length"], model["vocab_size"]) == (5e4, SEQ, VOCAB)
    assert meta["health"]["healthy"] and meta["contents"] == "weights"
    assert meta["layout"] == {"tp": 1, "pp": 1, "vp": 1, "dp": 1, "distributed_optimizer": False,
                              "ep": 1, "expert_tp": 1}
    assert meta["imported_from"]["model_type"] == "qwen3"
    tok = HFTokenizer(os.path.join(out, "tokenizer", "tokenizer.json"))
    assert tok.encode("the lazy fox") == HFTokenizer(os.path.join(hf_dirs["qwen3_tied"],
                                                                  "tokenizer.json")).encode(
        "the lazy fox")

    given = [f"hydra.searchpath=[file://{out}/configs]", "model=qwen3_tied",
             f"train.load_dir={out}", "mixer=attnres_block",
             f"output_dir={tmp_path}"]
    run = compose_run(*given, "train.load_weights_only=true")
    assert json.loads(json.dumps(dataclasses.asdict(run.model))) == model
    preflight(run, 1, data=False)  # a ConfigError on anything that would stop the start


def test_a_full_resume_of_an_import_is_refused_naming_the_option(imported):
    """No optimizer state, step or data position: only a weights-only start."""
    from depthmix.config.load import compose_run
    from depthmix.checkpoint.resume import preflight_checkpoint
    from depthmix.config.schema import ConfigError

    out = imported["qwen3"]
    run = compose_run(f"hydra.searchpath=[file://{out}/configs]", "model=qwen3",
                      f"train.load_dir={out}")
    with pytest.raises(ConfigError, match="train.load_weights_only=true"):
        preflight_checkpoint(run)


def test_depthmix_generate_takes_the_import_directory(imported, capsys):
    from depthmix.cli.generate import main

    assert main([imported["llama"], "-p", "the lazy", "-n", "4", "--format", "jsonl"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["prompt"] == "the lazy" and len(line["tokens"]) == 4


def test_a_directory_without_a_checkpoint_names_the_closest_below_it(imported, tmp_path,
                                                                     capsys):
    """A directory above the imports: every command says what it looked for and names the
    nearest checkpoint directory below (the newest of equals), then ``train.load_dir`` too
    (at start-up)."""
    from depthmix.checkpoint.resume import preflight_checkpoint
    from depthmix.checkpoint.store import TRACKER
    from depthmix.cli.generate import main as generate
    from depthmix.config.load import compose_run
    from depthmix.config.schema import ConfigError

    root = os.path.dirname(imported["qwen3"])
    newest = max((checkpoints(out) for out in imported.values()), key=os.path.getmtime)
    assert generate([root, "-p", "the"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"checkpoint={root} holds no checkpoint (looked for {TRACKER}" in err, err
    assert err.endswith(f"the closest checkpoint directory below it: checkpoint={newest}"), err

    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    os.symlink(imported["qwen3"], deep / "model")
    (tmp_path / "near").mkdir()  # holds nothing: not the answer
    run = compose_run(f"hydra.searchpath=[file://{imported['qwen3']}/configs]", "model=qwen3",
                      f"train.load_dir={tmp_path}", "train.load_weights_only=true")
    with pytest.raises(ConfigError, match=rf"train.load_dir={tmp_path} holds no checkpoint .*"
                                          rf"below it: train.load_dir={deep}/model/checkpoints$"):
        preflight_checkpoint(run)


# ---------------------------------------------------------------------------------------
# What does not map, and the command contract
# ---------------------------------------------------------------------------------------

REFUSED = {  # config.json change -> the field named
    "rope_scaling": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    "rope_type": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
                  "rope_parameters.rope_type=yarn"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=true"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=true"),
    "moe": ({"num_local_experts": 8}, "num_local_experts=8"),  # a Mixtral field on Llama
    "sliding": ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
    "qwen2": ({"model_type": "qwen2"}, "model_type=qwen2"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act=gelu"),
    "head_dim": ({"head_dim": 32}, "head_dim=32"),  # the weights have 16
}


MOE_REFUSED = {  # config.json change of the Qwen3-MoE model -> the field named
    "shared_expert": ({"shared_expert_intermediate_size": 64},
                      "shared_expert_intermediate_size=64"),
    "layers": ({"decoder_sparse_step": 1, "mlp_only_layers": [2]}, "mlp_only_layers=[2]"),
    "top_k": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "no_experts": ({"mlp_only_layers": [1, 3]}, "no layer has experts"),
    "moe_width": ({"moe_intermediate_size": 40}, "moe_intermediate_size=40"),  # weights: 32
}
CASES = [("llama", case, *REFUSED[case]) for case in REFUSED] + [
    ("qwen3_moe", case, *MOE_REFUSED[case]) for case in MOE_REFUSED]


def _edited(source: str, dest, changes: dict) -> str:
    os.makedirs(dest)
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), os.path.join(dest, name))
    os.remove(os.path.join(dest, "config.json"))
    config = {**json.load(open(os.path.join(source, "config.json"))), **changes}
    json.dump(config, open(os.path.join(dest, "config.json"), "w"))
    return str(dest)


@pytest.mark.parametrize("kind,case,changes,field", CASES, ids=[c[1] for c in CASES])
def test_what_does_not_map_is_refused_naming_the_field(kind, case, changes, field, hf_dirs,
                                                       tmp_path, capsys):
    from depthmix.cli.importer import main

    source = _edited(hf_dirs[kind], tmp_path / "src", changes)
    assert main([source, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out")


def test_a_bias_tensor_is_refused_naming_it(hf_dirs, tmp_path, capsys):
    """A checkpoint whose config says nothing of biases but whose weights carry one."""
    from safetensors.torch import load_file, save_file

    from depthmix.cli.importer import main

    source = tmp_path / "src"
    source.mkdir()
    for name in ("config.json", "tokenizer.json"):
        os.symlink(os.path.join(hf_dirs["qwen3"], name), source / name)
    weights = load_file(os.path.join(hf_dirs["qwen3"], "model.safetensors"))
    weights["model.layers.2.self_attn.q_proj.bias"] = torch.zeros(96)
    save_file(weights, str(source / "model.safetensors"))
    assert main([str(source), str(tmp_path / "out")]) == 2
    assert "model.layers.2.self_attn.q_proj.bias" in capsys.readouterr().err


@pytest.mark.parametrize("first,freq", [(0, 1), (1, 1), (1, 2), (0, 3), (2, 2), (5, 1)])
def test_expert_layers_survive_export_then_import(first, freq):
    """``model.moe``'s layers -> ``decoder_sparse_step`` / ``mlp_only_layers`` -> the same
    ``model.moe``; ``config.json`` as transformers 4 wrote it (``num_experts``) and as 5
    writes it (``num_local_experts``)."""
    from depthmix.config.schema import ModelConfig, MoEConfig
    from depthmix.hf.architecture import hf_config, hf_moe_layers, model_config

    model = ModelConfig(num_layers=6, head_dim=32, moe=MoEConfig(
        num_experts=8, top_k=2, ffn_hidden_size=64, first_dense_layers=first, layer_freq=freq,
        normalize_top_k=False, aux_loss_coeff=1e-3))
    config = hf_config(model)
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 8
    assert hf_moe_layers(config) == [i for i in range(6) if model.moe.is_moe_layer(i)]
    for v5 in (False, True):
        if v5:
            config["num_local_experts"] = config.pop("num_experts")
        back = model_config(config, model.name)
        assert [back.moe.is_moe_layer(i) for i in range(6)] == \
            [model.moe.is_moe_layer(i) for i in range(6)]
        assert (back.moe.num_experts, back.moe.top_k, back.moe.ffn_hidden_size,
                back.moe.normalize_top_k, back.moe.aux_loss_coeff) == (8, 2, 64, False, 1e-3)


def test_prepare_refuses_a_missing_folder(tmp_path):
    """``prepare()`` called from Python (the CLI checks the path before it)."""
    from depthmix.config.schema import ConfigError
    from depthmix.hf.importer import prepare

    with pytest.raises(ConfigError, match="hf_dir=/no/such/model: no such directory"):
        prepare("/no/such/model", str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,named", [
    (["--seq-lenght", "16"], "--seq-lenght"),
    (["--precision", "fp8"], "--precision"),
    ([], "hf_dir=/no/such/model"),
], ids=["typo", "bad-choice", "missing-path"])
@pytest.mark.multiproc(at_once=1)
def test_bad_input_exits_2_at_once_naming_it(args, named, tmp_path):
    """A fresh process: one line naming the option, no library noise, in under 3 s."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "depthmix.cli.importer", "/no/such/model",
                           str(tmp_path / "out"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert proc.stdout == "" and "Warning" not in proc.stderr
    assert seconds < 3, f"{seconds:.1f} s"


def test_help_shows_the_defaults(capsys):
    from depthmix.cli.importer import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "default: max_position_embeddings" in text and "default: config.json's dtype" in text
