"""Adding a mixer takes one folder (plus, in the tree, its YAML and doc page): a toy mixer
package written to a tmp dir and put on the registry's search path is picked up by
``depthmix-train --help``, the Hydra config, every shared test matrix, the roofline's step
floor and ``tools/gpu_bench.py``'s matrix without another edit (the matrices' own cases: a
nested pytest run, the full lane; that every matrix takes every registered mixer:
``tests/test_grids.py``); the overheads test asks for the one thing it cannot know (a closed
form); a folder that lacks a required hook is refused with a message naming it."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from depthmix.config.schema import ConfigError
from depthmix.mixers import ENV_PATH, available, get_mixer, has_yaml, register_search_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOY_INIT = '''\
"""``mixer=toy``: vanilla with a learned gate on every sublayer's output,
``h + sigmoid(w . y + b) y``."""

from dataclasses import dataclass

from depthmix.mixers.base import ExtraParams, Mixer, MixerConfig, OpCall, SavedActivations
from depthmix.mixers.base import model_hook, residual_plan


@dataclass
class ToyConfig(MixerConfig):
    name: str = "{name}"
    gate_bias: float = 4.0
    """Initial bias ``b`` of the gates (their weights ``w`` start at zero)."""


def extra_flops_per_token(config):
    """The gate's projection ``w . y``, ``2h`` per sublayer."""
    return 2 * config.unrolled_layers * 2 * config.hidden_size


def extra_params(config, tp=1):
    """``w`` and ``b`` per sublayer, replicated."""
    return ExtraParams(layers=(2 * (config.hidden_size + 1),) * config.num_layers)


def saved_activations(config, tp, micro_batch):
    """Per sublayer the output ``y`` (for ``w``'s gradient and the product) and the gate."""
    t = tp if config.sequence_parallel else 1
    per = 2 * (config.hidden_size + 1) / t
    return SavedActivations(layers={u: per for u in range(config.unrolled_layers)})


def step_work(config, tokens):
    """Per sublayer the gate, elementwise over ``y``: read it, write the gated output,
    ``w . y``, the sigmoid and the product (``4h`` a token)."""
    th = tokens * config.hidden_size
    return [OpCall("toy gate", f"sublayer {i}", "elementwise", (th, th, 4 * th))
            for i in range(1, 2 * config.unrolled_layers + 1)]


MIXER = Mixer(
    name="{name}",
    config_cls=ToyConfig,
    model_spec=model_hook(__name__, "get_toy_model_spec"),
    plan=residual_plan,
    extra_flops_per_token=extra_flops_per_token,
    extra_params=extra_params,
    saved_activations=saved_activations,
    step_work=step_work,
)
'''

TOY_MODEL = '''\
"""The toy mixer's residual: ``h + sigmoid(w . y + b) y``."""

import dataclasses

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from depthmix.megatron_ext.layer import ResidualOp, mark_mixing_parameter
from depthmix.megatron_ext.specs import get_decoder_layer_submodules, get_model_submodules


class GatedResidual(ResidualOp):
    def __init__(self, config, layer_number=1, sublayer="attn", **kwargs):
        super().__init__(config, layer_number=layer_number, sublayer=sublayer, **kwargs)
        dtype = config.params_dtype
        self.gate_weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=dtype))
        self.gate_bias = torch.nn.Parameter(torch.full((1,), config.mixer.gate_bias, dtype=dtype))
        for param in (self.gate_weight, self.gate_bias):
            mark_mixing_parameter(param, config)

    def write(self, state, output, token, ctx):
        gate = torch.sigmoid(torch.nn.functional.linear(output, self.gate_weight, self.gate_bias))
        super().write(state, gate * output, token, ctx)  # [s, b, 1] * [s, b, h]


def get_toy_model_spec(config):
    layer = get_decoder_layer_submodules(config)
    gated = ModuleSpec(module=GatedResidual, params=layer.attn_residual.params)
    layer = dataclasses.replace(layer, attn_residual=gated, mlp_residual=gated)
    return get_model_submodules(config, layer)
'''


def write_mixer(root, name: str, init: str = TOY_INIT, model: str = TOY_MODEL) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(init.replace("{name}", name))
    (folder / "model.py").write_text(model)
    return str(folder / "__init__.py")


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory):
    """One folder for the module: ``depthmix.mixers.toy`` is imported once per process."""
    root = tmp_path_factory.mktemp("mixers")
    write_mixer(root, "toy")
    return root


@pytest.fixture
def toy(toy_path, monkeypatch):
    """``toy`` on the search path, for this process and the processes it starts."""
    monkeypatch.setenv(ENV_PATH, str(toy_path))
    return "toy"


def env_with(path) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env[ENV_PATH] = str(path)
    return env


def test_registry_and_hydra_take_the_toy(toy):
    assert toy in available() and get_mixer(toy).config_cls.__name__ == "ToyConfig"
    assert not has_yaml(toy)  # its mixer=toy choice is made from ToyConfig
    from depthmix.config.load import compose_run

    run = compose_run("mixer=toy", "mixer.gate_bias=2.5", "mixer.short_swa_window=2")
    assert (run.mixer.name, run.mixer.gate_bias, run.mixer.short_swa_window) == ("toy", 2.5, 2)
    with pytest.raises(Exception, match="gate_bais"):
        compose_run("mixer=toy", "mixer.gate_bais=1")


@pytest.mark.multiproc(at_once=1)
def test_help_lists_the_toy_without_torch(toy, toy_path):
    probe = ("import sys\nfrom depthmix.cli.overrides import help_text\nprint(help_text())\n"
             "print(any(m.split('.')[0] in ('torch', 'megatron') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], env=env_with(toy_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "False"
    mixers = [f"{n}*" if n == "vanilla" else n for n in available()]
    assert f"  mixer: {', '.join(mixers)}" in lines and "toy" in mixers
    assert "mixer=toy options:" in lines and "  mixer.gate_bias: float = 4.0" in lines


def test_the_roofline_and_the_gpu_bench_matrix_take_the_toy(toy):
    """Its own op calls in the roofline's step floor (its ``step_work`` hook) and its rows
    in ``tools/gpu_bench.py --smoke``'s matrix, with no edit there (nothing runs)."""
    from depthmix.bench.roofline import step_extra_floor
    from depthmix.config.load import compose_run
    from tools_modules import load_tool

    run = compose_run("model=tiny", "mixer=toy", "train.micro_batch_size=2",
                      "train.global_batch_size=2")
    floor = step_extra_floor(run)
    assert list(floor.ops) == ["toy gate"] and floor.seconds > 0
    assert floor.ops["toy gate"]["calls"] == 2 * run.model.num_layers
    tool = load_tool("gpu_bench")
    smoke = tool.Matrix(tool.parse_args(["--smoke"]), {})
    assert "toy" in smoke.mixers
    assert ("toy", "torch", "eager") in tool.mixer_rows(smoke, smoke.mixer_modes)


# test file -> its tests that must run the toy (or check it among every mixer) and pass
MATRICES = {
    "tests/mixers/test_conformance.py": {"test_incremental_decoding_matches_full_forward[toy]",
                                         "test_recompute_gives_identical_gradients[toy]"},
    "tests/megatron_ext/test_transport.py": {
        "test_options_give_depth_state[toy]",
        "test_sent_and_cached_split_the_live_state[toy-pp2xvp2]",
        "test_packed_wire_carries_the_live_state[toy-pp4xvp2]"},
    "tests/planning/test_accounting.py": {"test_parameter_count_matches_every_mixer[toy]",
                                     "test_mixer_flops_match_the_model[toy]",
                                     "test_every_mixer_adds_flops_and_params_at_3b"},
    "tests/planning/test_memory_model.py": {"test_memory_model_matches_measurement[toy-dp2_distopt]"},
    "tests/planning/test_overheads.py": {"test_cli_prints_every_mixer"},
    "tests/inference/test_generate.py": {
        "test_batched_prompts_of_different_lengths_equal_each_alone[toy]"},
    "tests/config/test_cli.py": {"test_every_shipped_mixer_starts_with_the_defaults[toy]",
                                 "test_help_lists_real_choices_and_describes_every_option"},
}
ASKS_FOR = {"test_closed_forms[toy-500m]": "mixer 'toy' has no closed form in CLOSED",
            "test_closed_forms[toy-3b]": "mixer 'toy' has no closed form in CLOSED"}


@pytest.mark.full
@pytest.mark.multiproc
def test_every_matrix_runs_the_toy(toy, toy_path, tmp_path):
    """One pytest run of the matrix files with the toy on the search path: its cases are
    collected in every matrix and pass, except the closed form only a person can write."""
    report = tmp_path / "report.xml"
    ids = [f"{path}::{name}" for path, names in MATRICES.items() for name in sorted(names)]
    ids += [f"tests/planning/test_overheads.py::{name}" for name in ASKS_FOR]
    out = subprocess.run(  # a test id that was not collected fails the run (not found)
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", *ids], cwd=REPO, env=env_with(toy_path),
        capture_output=True, text=True, timeout=1500)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]  # 1: tests failed
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcomes[(case.get("classname").replace(".", "/") + ".py", case.get("name"))] = (
            "passed" if failed is None and case.find("skipped") is None
            else failed.get("message", "") if failed is not None else "skipped")
    summary = out.stdout[-3000:]
    for path, names in MATRICES.items():
        for name in names:
            assert outcomes.get((path, name)) == "passed", (path, name, summary)
    for name, message in ASKS_FOR.items():
        assert message in outcomes[("tests/planning/test_overheads.py", name)], summary
    failed = {k: v for k, v in outcomes.items() if v != "passed" and k[1] not in ASKS_FOR}
    assert not failed, json.dumps({f"{p}::{n}": m[:300] for (p, n), m in failed.items()})


HOOKS_REMOVED = {
    "plan": "    plan=residual_plan,\n",
    "model_spec": '    model_spec=model_hook(__name__, "get_toy_model_spec"),\n',
    "config_cls": "    config_cls=ToyConfig,\n",
}


@pytest.mark.parametrize("hook", sorted(HOOKS_REMOVED))
def test_a_mixer_without_a_required_hook_is_refused_naming_it(tmp_path, monkeypatch, hook):
    name = f"toy_without_{hook}"
    where = write_mixer(tmp_path, name, TOY_INIT.replace(HOOKS_REMOVED[hook], ""))
    monkeypatch.setenv(ENV_PATH, str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        available()
    assert str(refused.value) == f"mixer {name!r} ({where}) has no {hook}"


def test_other_gaps_are_named(tmp_path, monkeypatch):
    cases = {
        "toy_no_mixer": (TOY_INIT.replace("MIXER = Mixer(", "THING = Mixer("), TOY_MODEL,
                         "defines neither MIXER (a Mixer) nor MIXERS"),
        "toy_no_model": (TOY_INIT, None, "has no depthmix.mixers.toy_no_model.model"),
        "toy_no_transport": (TOY_INIT.replace(
            "    plan=residual_plan,\n",
            "    plan=residual_plan,\n    variants=(Variant(checks=('decode', 'recompute', "
            "'accounting', 'generate', 'parity')),),\n").replace(
            "import model_hook, residual_plan", "import Variant, model_hook, residual_plan"),
            TOY_MODEL, "has no variant for the 'transport' check"),
        "toy_bad_option": (TOY_INIT.replace(
            "    plan=residual_plan,\n",
            "    plan=residual_plan,\n    variants=(Variant(options={'gate_bais': 1.0}),),\n"
            ).replace("import model_hook, residual_plan",
                      "import Variant, model_hook, residual_plan"),
            TOY_MODEL, "variant '' sets unknown options ['gate_bais']"),
    }
    for name, (init, model, message) in cases.items():
        root = tmp_path / name
        write_mixer(root, name, init, model or "")
        if model is None:
            os.remove(root / name / "model.py")
        monkeypatch.setenv(ENV_PATH, str(root))
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            available()


def test_register_search_path(tmp_path, monkeypatch):
    import depthmix.mixers as registry

    write_mixer(tmp_path, "toy_registered")
    monkeypatch.setattr(registry, "_registered_paths", [])
    assert "toy_registered" not in available()
    register_search_path(str(tmp_path))
    assert "toy_registered" in available()


def test_builtin_mixers_have_their_yaml_doc_page_and_readme_entry():
    """What a mixer in the tree adds besides its folder: ``configs/mixer/<name>.yaml``,
    ``docs/methods/<folder>.md`` and its name in README's list of mixers."""
    import depthmix.mixers as registry

    with open(os.path.join(REPO, "README.md")) as f:
        readme = " ".join(f.read().split())
    listed = readme.split("`mixer` (", 1)[1].split(";", 1)[0]
    for name in available():
        package = get_mixer(name).model_spec.module.rsplit(".", 1)[0]  # depthmix.mixers.<folder>
        assert os.path.dirname(sys.modules[package].__file__) == os.path.join(
            registry.BUILTIN, package.split(".")[2]), f"{name} is not a built-in mixer"
        folder = package.split(".")[2]
        assert has_yaml(name), f"depthmix/configs/mixer/{name}.yaml is missing"
        assert os.path.isfile(os.path.join(REPO, "docs", "methods", f"{folder}.md")), folder
        assert name in [n.strip() for n in listed.split(",")], f"README's mixer list lacks {name}"
    yamls = sorted(f[:-5] for f in os.listdir(registry.YAML_DIR) if f.endswith(".yaml"))
    assert yamls == available()
