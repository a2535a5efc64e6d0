"""The lm-eval adapter: exact log-likelihoods, batching invariance, lm-eval's own evaluator
on local five-shot tasks (no network: the tasks read jsonl files written here; Depth-Attention
by default, the other mixers in the full lane)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from depthmix.testing import build_model, tiny_run

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from depthmix.config.schema import ConfigError  # noqa: E402
from depthmix.data.tokenizer import HFTokenizer, train_bpe_tokenizer  # noqa: E402
from depthmix.evaluate.harness import DepthmixLM, evaluate_tasks  # noqa: E402
from layouts import full_except  # noqa: E402

MIXERS = {"vanilla": {}, "depth_attn": {}, "moda": {}, "attnres_block": {"block_size": 4},
          "mhc": {}}
WORDS = ("red blue green cat dog bird sun moon star tree river stone one two three four "
         "five six seven eight nine ten").split()


def _questions(n, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        words = [WORDS[i] for i in torch.randint(0, len(WORDS), (3,), generator=g)]
        choices = [WORDS[i] for i in torch.randperm(len(WORDS), generator=g)[:4]]
        docs.append({"question": " ".join(words), "choices": choices,
                     "label": int(torch.randint(0, 4, (1,), generator=g)),
                     "answer": choices[0], "text": " ".join(words + choices)})
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4
    train_bpe_tokenizer(texts, vocab_size=300, path=str(path))
    return HFTokenizer(str(path))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Three local tasks: multiple choice, generation, rolling log-likelihood."""
    root = tmp_path_factory.mktemp("tasks")
    for split, (n, seed) in {"train": (8, 1), "test": (6, 2)}.items():
        with open(root / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in _questions(n, seed))
    data = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    train: {root / 'train.jsonl'}\n    test: {root / 'test.jsonl'}\n"
            "training_split: train\ntest_split: test\nfewshot_split: train\n"
            "metadata:\n  version: 1.0\n")
    (root / "dm_mc.yaml").write_text(
        "task: dm_mc\noutput_type: multiple_choice\n" + data
        + "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: \"{{label}}\"\n"
          "doc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n"
          "  - metric: acc_norm\n")
    (root / "dm_gen.yaml").write_text(
        "task: dm_gen\noutput_type: generate_until\n" + data
        + "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: \" {{answer}}\"\n"
          "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
          "metric_list:\n  - metric: exact_match\n")
    (root / "dm_ppl.yaml").write_text(
        "task: dm_ppl\noutput_type: loglikelihood_rolling\n" + data
        + "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
          "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return root


@pytest.fixture(scope="module")
def checkpoint(megatron_single, tokenizer, tmp_path_factory):
    """A saved tiny vanilla model (fp32, 320 tokens, 256-token context) with the tokenizer."""
    from depthmix.testing import train_and_save

    run = tiny_run("vanilla")
    run.model.vocab_size, run.model.seq_length = 320, 256
    run.train.micro_batch_size = run.train.global_batch_size = 1
    run.logger.wandb = False
    return train_and_save(run, str(tmp_path_factory.mktemp("ckpt") / "checkpoints"),
                          tokenizer.path)


@pytest.fixture(autouse=True)
def _offline_datasets(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf"))


_models = {}


def model_for(mixer):
    """A tiny fp32 model of ``mixer`` with a 320-token vocabulary and 256-token context,
    so that no request here is cut (built once)."""
    if mixer not in _models:
        run = tiny_run(mixer, **MIXERS[mixer])
        run.model.vocab_size, run.model.seq_length = 320, 256
        torch.manual_seed(0)
        _models[mixer] = build_model(run).eval()
    return _models[mixer]


def direct_loglikelihood(model, tok, context, continuation):
    """lm-eval's split (the context's own tokens, then the whole text's tokens past as
    many), one plain forward."""
    ctx = tok.encode(context.rstrip()) if context else [tok.eod]
    whole = tok.encode(context + continuation) if context else ctx + tok.encode(continuation)
    cont = whole[len(ctx):]
    with torch.no_grad():
        logits = model(torch.tensor([(ctx + cont)[:-1]]))[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[len(ctx) - 1:]
    target = torch.tensor(cont)
    return float(logprobs.gather(-1, target[:, None]).sum()), \
        bool((logprobs.argmax(-1) == target).all())


REQUESTS = [("Q: red cat dog\nA:", " blue"), ("Q: one\nA:", " two three four five"),
            ("", "sun moon star"), ("Q: river stone tree bird nine ten\nA:", " seven"),
            ("Q: red\nA:", " green"), ("five six", " seven eight nine")]


def _instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_loglikelihood_is_the_models_own_and_batching_free(megatron_single, tokenizer, mixer):
    model = model_for(mixer)
    lm1 = DepthmixLM(model=(model, tokenizer), batch_size=1)
    lm4 = DepthmixLM(model=(model, tokenizer), batch_size=4)
    one = lm1.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    four = lm4.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    again = lm4.loglikelihood(_instances("loglikelihood", REQUESTS), disable_tqdm=True)
    for (ctx, cont), a, b in zip(REQUESTS, one, four):
        direct = direct_loglikelihood(model, tokenizer, ctx, cont)
        assert a == direct, (mixer, ctx, cont, a, direct)  # same input, same fp32 forward
        assert math.isclose(b[0], direct[0], rel_tol=1e-6, abs_tol=1e-5), (mixer, b, direct)
        assert b[1] == direct[1]
    assert four == again  # deterministic


def test_a_continuation_inside_the_contexts_last_token_scores_that_token(megatron_single,
                                                                          tokenizer):
    """``"Q: red\\nA: blu"`` + ``"e"``: the whole text ends in one token ``blue``, so
    lm-eval's split leaves no continuation token (its ``hf`` model asserts on that). The
    last token moves into the continuation; the other requests are scored as ever."""
    from lm_eval.api.model import TemplateLM

    model = model_for("vanilla")
    lm = DepthmixLM(model=(model, tokenizer), batch_size=2)
    merged = ("Q: red\nA: blu", "e")
    assert TemplateLM._encode_pair(lm, *merged)[1] == []  # the case arises here
    requests = [REQUESTS[0], merged, REQUESTS[1]]
    scores = lm.loglikelihood(_instances("loglikelihood", requests), disable_tqdm=True)
    whole = tokenizer.encode("".join(merged))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0, -1].float(), -1)
    assert math.isclose(scores[1][0], float(logprobs[whole[-1]]), rel_tol=1e-6, abs_tol=1e-5)
    for (ctx, cont), got in zip([REQUESTS[0], REQUESTS[1]], [scores[0], scores[2]]):
        want = direct_loglikelihood(model, tokenizer, ctx, cont)
        assert math.isclose(got[0], want[0], rel_tol=1e-6, abs_tol=1e-5), (ctx, got, want)


def test_loglikelihood_rolling_sums_disjoint_windows(megatron_single, tokenizer):
    """A text longer than max_length: windows of 16 tokens, every token scored once."""
    model = model_for("vanilla")
    text = " ".join(WORDS * 2)
    ids = tokenizer.encode(text)
    assert len(ids) > 40
    lm = DepthmixLM(model=(model, tokenizer), batch_size=3, max_length=16)
    (rolling,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]),
                                          disable_tqdm=True)
    expected = 0.0  # by hand: window i predicts ids[16i : 16i+16] from up to 16 tokens
    with torch.no_grad():
        for start in range(0, len(ids), 16):
            end = min(len(ids), start + 16)
            context = ([tokenizer.eod] + ids)[max(0, end - 16): end]  # the last 16 inputs
            logprobs = torch.log_softmax(model(torch.tensor([context]))[0].float(), -1)
            n = end - start
            expected += float(logprobs[-n:].gather(-1, torch.tensor(ids[start:end])[:, None]).sum())
    assert math.isclose(rolling, expected, rel_tol=1e-6)


def test_generate_until_matches_greedy_generation(megatron_single, tokenizer):
    from depthmix.inference.generate import generate

    model = model_for("moda")
    contexts = ["Q: red cat\nA:", "Q: one two three four five\nA:", "Q: sun\nA:"]
    lm = DepthmixLM(model=(model, tokenizer), batch_size=3)
    args = [(c, {"until": ["\n"], "max_gen_toks": 5}) for c in contexts]
    outs = lm.generate_until(_instances("generate_until", args), disable_tqdm=True)
    for context, out in zip(contexts, outs):
        ids = torch.tensor([tokenizer.encode(context)])
        alone = generate(model, ids, 5, eos_id=tokenizer.eod)[0, ids.shape[1]:].tolist()
        if tokenizer.eod in alone:
            alone = alone[:alone.index(tokenizer.eod)]
        assert out == tokenizer.decode(alone).split("\n")[0], (context, out)


@pytest.mark.multiproc(at_once=1)
@pytest.mark.parametrize("mixer", full_except(MIXERS, {"depth_attn"}))
def test_five_shot_local_tasks_through_lm_evals_evaluator(megatron_single, tokenizer,
                                                           task_dir, mixer):
    model = model_for(mixer)
    out = evaluate_tasks((model, tokenizer), ["dm_mc", "dm_gen", "dm_ppl"], num_fewshot=5,
                         batch_size=4, limit=4, include_path=str(task_dir),
                         include_defaults=False, log_samples=True)
    results = out["results"]
    assert out["n-shot"]["dm_mc"] == 5
    assert 0.0 <= results["dm_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["dm_gen"]["exact_match,none"] <= 1.0
    assert results["dm_ppl"]["word_perplexity,none"] > 1.0
    samples = out["samples"]["dm_mc"]
    assert len(samples) == 4
    for sample in samples:  # lm-eval's recorded scores are the model's own log-likelihoods
        context, _ = sample["arguments"][0]
        assert context.count("Q: ") == 6, "five shots plus the question"
        for (ctx, cont), resp in zip(sample["arguments"], sample["resps"]):
            direct = direct_loglikelihood(model, tokenizer, ctx, cont)
            # batches of 4: equal up to fp32 summation order (batch 1 is exact, above)
            assert math.isclose(resp[0][0], direct[0], rel_tol=1e-6), (resp, direct)
        best = max(range(4), key=lambda i: sample["resps"][i][0][0])
        assert sample["acc"] == float(best == sample["target"])


@pytest.mark.multiproc(at_once=1)
def test_eval_tasks_run_in_the_precision_asked_for(megatron_single, tokenizer, task_dir,
                                                   checkpoint, tmp_path):
    """``depthmix-eval train.precision=bf16 eval.tasks=[...]`` on an fp32 checkpoint: the
    tasks' log-likelihoods are a bf16 forward's (not fp32's) and the results say bf16."""
    from depthmix.evaluate.job import compose_job, run_job
    from depthmix.inference.load import load_model

    ckpt = checkpoint
    results = run_job(compose_job(
        f"eval.checkpoint={ckpt}", "eval.tasks=[dm_ppl]", f"eval.include_path={task_dir}",
        "eval.limit=3", "eval.batch_size=1", "train.precision=bf16", "logger=none",
        f"eval.output={tmp_path}/bf16.json"))
    assert results["precision"] == "bf16" and results["tasks_dtype"] == "bfloat16"
    with open(task_dir / "test.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f][:3]

    def word_perplexity(dtype):
        model = load_model(ckpt, impl="torch", dtype=dtype).model
        total = 0.0
        for text in texts:  # one rolling window each: the end-of-document token first
            ids = tokenizer.encode(text)
            with torch.no_grad():
                logits = model(torch.tensor([[tokenizer.eod] + ids[:-1]]))[0, :, :320]
            logprobs = torch.log_softmax(logits.float(), -1)
            total += float(logprobs.gather(-1, torch.tensor(ids)[:, None]).sum())
        return math.exp(-total / sum(len(t.split()) for t in texts))

    got = results["tasks"]["results"]["dm_ppl"]["word_perplexity,none"]
    assert math.isclose(got, word_perplexity(torch.bfloat16), rel_tol=1e-6)
    # an untrained model's bf16 and fp32 perplexities differ by ~1e-4 relative (9e-5 on one
    # machine, more on another): ten times the tolerance of the bf16 match tells them apart
    assert not math.isclose(got, word_perplexity(torch.float32), rel_tol=1e-5)


FRESH_INTERPRETER = r"""
import json, sys

from depthmix import runtime
from depthmix.evaluate.harness import evaluate_tasks  # registers lm-eval's model "depthmix"
from depthmix.inference.load import load_model
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

checkpoint, tasks = sys.argv[1:]
installed = [runtime.is_installed()]  # importing patches nothing
loaded = load_model(checkpoint)
installed.append(runtime.is_installed())
runtime.uninstall()  # as fresh again: the next entry point installs it itself
manager = TaskManager(include_path=tasks, include_defaults=False)
theirs = simple_evaluate(model="depthmix", model_args={"checkpoint": checkpoint},
                         tasks=["dm_mc"], batch_size=2, limit=3, task_manager=manager)
installed.append(runtime.is_installed())
runtime.uninstall()
ours = evaluate_tasks(loaded, ["dm_mc"], batch_size=2, limit=3, include_path=tasks,
                      include_defaults=False)
installed.append(runtime.is_installed())
runtime.uninstall()
from depthmix.config.load import compose_run
from depthmix.pretrain.trainer import Trainer
from depthmix.testing import SyntheticData

trainer = Trainer(compose_run("model=tiny", "model.seq_length=16", "train.micro_batch_size=1",
                              "train.global_batch_size=1", "logger=none"),
                  data=SyntheticData, callbacks=[])
losses = [trainer.train_one_step().loss for _ in range(2)]
installed.append(runtime.is_installed())
print(json.dumps({"installed": installed, "device": str(next(loaded.model.parameters()).device),
                  "results": [r["results"]["dm_mc"]["acc,none"] for r in (theirs, ours)],
                  "losses": losses}))
"""


@pytest.mark.multiproc(at_once=1)
def test_the_library_works_from_a_fresh_interpreter_on_cpu(checkpoint, task_dir):
    """docs/evaluation.md's Python entry points with no set-up: ``load_model`` and lm-eval's
    ``simple_evaluate(model="depthmix")`` (``DepthmixLM``), then ``evaluate_tasks``, then a
    ``Trainer`` taking two steps, each from a process without :mod:`depthmix.runtime`
    installed, on CPU (no CUDA visible)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER, checkpoint, str(task_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"] == [False, True, True, True, True] and out["device"] == "cpu", out
    assert out["results"][0] == out["results"][1] and 0.0 <= out["results"][0] <= 1.0, out
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"]), out


def test_unknown_task_lists_close_matches(megatron_single, tokenizer, task_dir):
    with pytest.raises(ConfigError, match=r"dm_mcq.*did you mean: dm_mc"):
        evaluate_tasks((model_for("vanilla"), tokenizer), ["dm_mcq"], include_path=str(task_dir),
                       include_defaults=False)


def test_shipped_table1_group_lists_the_papers_tasks():
    import yaml

    from depthmix.evaluate.harness import TASKS_DIR, task_manager

    with open(f"{TASKS_DIR}/depth_attn_table1.yaml") as f:
        group = yaml.safe_load(f)
    assert group["task"] == ["lambada_openai", "piqa", "winogrande", "sciq", "hellaswag",
                             "arc_easy", "arc_challenge", "race"]
    assert "depth_attn_table1" in task_manager(include_defaults=False).all_groups
