"""What ``depthmix-train`` does before Hydra runs.

* ``--help``: the config groups and their choices, and every option with its type, default
  and description, read from the config dataclasses' field docstrings (with :mod:`ast`);
  the mixers come from their registry, whose folders' ``__init__`` import neither torch
  nor Megatron, so printing help imports neither.
* The overrides are composed (every point of a multirun) before Hydra starts: a Hydra-level
  error (bad syntax, unknown key, unknown group option, a value of the wrong type) is a
  :class:`ConfigError` naming the closest valid names, i.e. exit status 2 and one line
  (:func:`depthmix.cli.command.command`).
* ``-m ... train.dry_run=true`` checks every point itself (no launcher, no output
  directories) and prints one verdict per point.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from depthmix.config.schema import ConfigError
from depthmix.config.validate import closest
from depthmix.runtime import exit_codes

APP = "depthmix-train"
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCHEMA = os.path.join(_PACKAGE, "config", "schema.py")
_MIXERS = os.path.join(_PACKAGE, "mixers")
GROUP_SCHEMAS = {"model": "ModelConfig", "parallel": "ParallelConfig", "data": "DataConfig",
                 "train": "TrainConfig", "logger": "LoggerConfig"}
"""Config groups backed by a dataclass of :mod:`depthmix.config.schema` (``mixer``: per method)."""
CHECKED_SCHEMAS = {**GROUP_SCHEMAS, "eval": "EvalConfig"}
"""Groups whose option names an override is checked against (``eval``: depthmix-eval's)."""
TOP_LEVEL_KEYS = ("output_dir",)


# ------------------------------------------------------------------------ what exists
def groups() -> List[str]:
    """The config groups a user chooses from (``hydra/`` holds Hydra's logging only)."""
    return sorted(d for d in os.listdir(CONFIG_DIR)
                  if os.path.isdir(os.path.join(CONFIG_DIR, d))
                  and not d.startswith("_") and d != "hydra")


def group_options(group: str) -> List[str]:
    """The YAML files of a group (the ``*_schema`` entries of the config store are not
    choices); for ``mixer``, the registered mixers."""
    if group == "mixer":
        from depthmix.mixers import available

        return available()
    folder = os.path.join(CONFIG_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def group_defaults() -> Dict[str, Optional[str]]:
    import yaml

    with open(os.path.join(CONFIG_DIR, "config.yaml")) as f:
        entries = yaml.safe_load(f)["defaults"]
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items()}


@dataclass
class Option:
    name: str
    type: str
    default: str
    doc: str


@functools.lru_cache(maxsize=None)
def _module(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def class_options(path: str, cls: str) -> List[Option]:
    """The fields a dataclass declares itself, with the docstring under each."""
    for node in _module(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out, body = [], node.body
            for i, item in enumerate(body):
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                annotation = ast.unparse(item.annotation)
                if annotation.startswith("ClassVar"):
                    continue
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    doc = " ".join(nxt.value.value.split())
                default = ast.unparse(item.value) if item.value is not None else ""
                if default.startswith("field(default_factory="):
                    default = {"list": "[]", "dict": "{}"}.get(default[22:-1], default)
                out.append(Option(item.target.id, annotation, default, doc))
            return out
    raise KeyError(f"{cls} not in {path}")


def schema_options(group: str) -> List[Option]:
    return class_options(_SCHEMA, CHECKED_SCHEMAS[group])


def moe_options() -> List[Option]:
    """``model.moe.<option>``: the experts (:class:`~depthmix.config.schema.MoEConfig`)."""
    return class_options(_SCHEMA, "MoEConfig")


def mixer_classes() -> Dict[str, Tuple[str, str]]:
    """``mixer name -> (source file, config class name)`` of every registered mixer."""
    from depthmix.mixers import available, get_mixer

    classes = {name: get_mixer(name).config_cls for name in available()}
    return {name: (inspect.getsourcefile(cls), cls.__name__) for name, cls in classes.items()}


def mixer_options(name: Optional[str] = None) -> List[Option]:
    """Options every mixer has (``name=None``), or those only ``mixer=<name>`` adds."""
    base = class_options(os.path.join(_MIXERS, "base.py"), "MixerConfig")
    if name is None:
        return [o for o in base if o.name != "name"]
    path, cls = mixer_classes()[name]
    if cls == "MixerConfig":
        return []
    return [o for o in class_options(path, cls) if o.name != "name"]


def group_fields(group: str, mixer: Optional[str] = None) -> List[str]:
    if group == "mixer":
        return ["name", *(o.name for o in mixer_options()),
                *(o.name for o in mixer_options(mixer or "vanilla"))]
    return [o.name for o in schema_options(group)]


# ------------------------------------------------------------------------ --help
def _wrap(text: str, indent: int, width: int = 96) -> str:
    return textwrap.fill(text, width=width, initial_indent=" " * indent,
                         subsequent_indent=" " * indent)


def _value(node, name: str, default: str) -> str:
    """The composed config's value of an option (interpolations unresolved), else the
    schema's default."""
    from omegaconf import OmegaConf

    if node is None or name not in node:
        return default
    value = OmegaConf.to_container(node, resolve=False)[name]
    if isinstance(value, dict):  # a nested group (model.moe): its options are listed apart
        return f"{{{len(value)} options, listed below}}"
    return "null" if value is None else str(value)


def _describe(prefix: str, options: Sequence[Option], node=None) -> List[str]:
    lines = []
    for o in options:
        lines.append(f"  {prefix}{o.name}: {o.type} = {_value(node, o.name, o.default)}")
        lines.append(_wrap(o.doc or "(undocumented)", 6))
    return lines


RUN_NAME_DOC = ("The run's fixed output directory outputs/<name> (a multirun's: "
                "multirun/<name>); re-running the same command resumes from its last "
                "checkpoint. May hold slashes. null = a fresh directory per run.")


def help_text(cfg=None, overrides: Sequence[str] = ()) -> str:
    """``cfg``: the composed config of ``overrides``, whose values the options show."""
    defaults = group_defaults()
    lines = [
        f"{APP}: pretrain a depth-mixing transformer on Megatron-Core",
        "",
        "Usage:",
        f"  {APP} [group=choice ...] [group.option=value ...]",
        f"  {APP} -m mixer=depth_attn mixer.stride=1,2 model=tiny      one run per point",
        f"  {APP} model=3b parallel=tp2_pp4 train=paper train.dry_run=true parallel.world_size=64",
        "  torchrun --nproc-per-node 8 -m depthmix.cli.train model=3b parallel=tp2_pp4",
        "",
        *textwrap.wrap(exit_codes.HELP, 96),
        "",
        "Config groups (choose one with group=choice; the default is marked *):",
    ]
    for group in groups():
        choices = [f"{c}*" if c == defaults.get(group) else c for c in group_options(group)]
        lines.append(f"  {group}: {', '.join(choices)}")
    get = (lambda key: cfg.get(key)) if cfg is not None else (lambda key: None)
    where = f"the values composed for {' '.join(overrides)}" if overrides else \
        "the values of the default presets"
    lines += ["", f"Options show {where}.", "", "run options:",
              f"  run.name: Optional[str] = {_value(get('run'), 'name', 'None')}",
              _wrap(RUN_NAME_DOC, 6)]
    for group in GROUP_SCHEMAS:
        lines += ["", f"{group} options ({group}.<option>=value; the preset in configs/{group}/ "
                  "sets some):"]
        lines += _describe(f"{group}.", schema_options(group), get(group))
        if group == "model":
            moe = get("model").get("moe") if get("model") is not None else None
            lines += ["", "model.moe options (mixture-of-experts layers; docs/moe.md):"]
            lines += _describe("model.moe.", moe_options(), moe)
    chosen = str(get("mixer").name) if get("mixer") is not None else None
    lines += ["", "mixer options (every method):"]
    lines += _describe("mixer.", mixer_options(), get("mixer"))
    for name in sorted(mixer_classes()):
        own = mixer_options(name)
        if own:
            lines += ["", f"mixer={name} options:"]
            lines += _describe("mixer.", own, get("mixer") if name == chosen else None)
    lines += ["", "Hydra: --hydra-help for Hydra's own flags; --cfg job prints the composed "
              "config.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------ checking overrides
def _one_line(e: BaseException) -> str:
    parts = [str(e)]
    if e.__cause__ is not None and str(e.__cause__):
        parts.append(str(e.__cause__))
    text = ": ".join(p.strip().split("\n")[0] for p in parts if p.strip())
    return text or type(e).__name__


def _values(override) -> List[str]:
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    value = override.value()
    return ["null" if value is None else str(value)]


def _chosen_mixer(parsed, compose) -> Optional[str]:
    """The mixer the overrides choose; None when the config does not compose without the
    ``mixer.*`` overrides either (then the error is elsewhere)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for o in parsed:
        if o.key_or_group == "mixer" and not o.is_delete():
            return _values(o)[0]
    try:  # e.g. a sweep= preset may choose the mixer: ask the config without mixer.*
        plain = [o.input_line for o in parsed if not o.key_or_group.startswith("mixer.")]
        return str(compose(plain).mixer.name)
    except (HydraException, OmegaConfBaseException):
        return None


def diagnose(parsed, compose) -> Optional[str]:
    """The first override naming an unknown group, group choice or option, as a message
    with the closest valid names; None when none is found."""
    known_groups = groups()
    for o in parsed:
        key = o.key_or_group
        if o.is_delete() or o.package or key.startswith("hydra") or "/" in key:
            continue
        head, _, rest = key.partition(".")
        if not rest:
            if key in known_groups:
                options = group_options(key)
                for v in _values(o):
                    if v not in options and v != "null":
                        return (f"{key}={v} is not a {key} choice; choose one of "
                                f"{', '.join(options)}{closest(v, options)}")
            elif key not in TOP_LEVEL_KEYS:
                names = [*known_groups, *TOP_LEVEL_KEYS]
                return (f"{key} is neither a config group ({', '.join(known_groups)}) nor "
                        f"an option{closest(key, names)}")
            continue
        if head not in known_groups:
            names = [*known_groups, *TOP_LEVEL_KEYS]
            return f"{key}: {head} is not a config group{closest(head, names)}"
        if head not in CHECKED_SCHEMAS and head != "mixer":
            continue
        field = rest.split(".")[0]
        mixer = _chosen_mixer(parsed, compose) if head == "mixer" else None
        if head == "mixer" and mixer is None:
            continue  # another override breaks the config: that one is reported
        fields = group_fields(head, mixer)
        if key.startswith("model.moe."):
            head, field, fields = "model.moe", key.split(".")[2], [o.name for o in moe_options()]
        if field in fields:
            continue
        where = f"mixer={mixer}" if mixer else head
        owners = [n for n in sorted(mixer_classes()) if head == "mixer"
                  and field in group_fields("mixer", n)]
        hint = (f"; it is an option of {', '.join(f'mixer={n}' for n in owners)}" if owners
                else closest(f"{head}.{field}", [f"{head}.{f}" for f in fields]))
        return f"{head}.{field} is not an option of {where}{hint}"
    return None


def experts_of_a_dense_model(parsed, cfg) -> None:
    """An expert option (``model.moe.<x>``) for a model without experts is refused unless
    the overrides turn them on (``model.moe.num_experts``): at its default value the
    composed config could not tell it was given."""
    from depthmix.config.validate import no_experts

    given = [o for o in parsed if o.key_or_group.startswith("model.moe.") and not o.is_delete()]
    if not given or any(o.key_or_group == "model.moe.num_experts" for o in given):
        return
    model = cfg.get("model") or {}
    moe = model.get("moe")
    if moe is None or not moe.get("num_experts"):
        first = given[0]
        raise ConfigError(no_experts(f"{first.key_or_group}={_values(first)[0]}",
                                     model.get("name")))


@dataclass
class Point:
    overrides: List[str]
    label: str
    cfg: object


def compose_points(overrides: Sequence[str], multirun: bool = False,
                   config_name: str = "config") -> List[Point]:
    """Compose the configuration of every point (one without ``-m``); raises
    :class:`ConfigError` for anything Hydra would refuse."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from depthmix.config.store import register_configs

    register_configs()
    parser = OverridesParser.create()
    errors = (HydraException, OmegaConfBaseException)
    try:
        parsed = parser.parse_overrides(list(overrides))
    except errors as e:
        raise ConfigError(f"cannot parse the overrides: {_one_line(e)}") from None

    with initialize_config_module("depthmix.configs", version_base=None):
        def compose(items, hydra=False):
            return hydra_compose(config_name, overrides=list(items), return_hydra_config=hydra)

        def checked(items, hydra=False):
            try:
                cfg = compose(items, hydra)
            except errors as e:
                found = diagnose(parser.parse_overrides(list(items)), compose)
                raise ConfigError(found or _one_line(e)) from None
            experts_of_a_dense_model(parser.parse_overrides(list(items)), cfg)
            return cfg

        if not multirun:
            if any(o.is_sweep_override() for o in parsed):
                swept = next(o.input_line for o in parsed if o.is_sweep_override())
                raise ConfigError(f"{swept} lists several values: add -m (--multirun) to "
                                  "run one job per value, or quote a value with commas "
                                  "(key='a,b')")
            return [Point(list(overrides), " ".join(overrides), checked(overrides))]
        first = [o.input_line if not o.is_sweep_override()
                 else f"{o.get_key_element()}={_values(o)[0]}" for o in parsed]
        params = checked(first, hydra=True).hydra.sweeper.params or {}
        everything = parser.parse_overrides([*(f"{k}={v}" for k, v in params.items()),
                                             *overrides])
        swept = {o.key_or_group for o in everything if o.is_sweep_override()}
        (batch,) = BasicSweeper.split_arguments(everything, None)
        points = []
        for items in batch:
            label = " ".join(x for x in items if x.split("=", 1)[0].lstrip("+~") in swept)
            points.append(Point(items, label or " ".join(items) or "(defaults)",
                                checked(items)))
        return points


def hydra_points(argv: Sequence[str], config_name: str) -> Optional[List[Point]]:
    """Compose every point of a Hydra command's overrides before Hydra runs (an unknown
    key, group choice or bad value: a :class:`ConfigError` with the closest valid names,
    :func:`compose_points`); None for Hydra's own modes (``--hydra-help``, ``--info``, ...)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))
    if (args.hydra_help or args.shell_completion or args.config_dir or args.config_path
            or args.experimental_rerun or args.info or args.cfg):
        return None
    return compose_points(args.overrides, args.multirun, args.config_name or config_name)


def dry_run_verdict(run, label: str, world_size: Optional[int] = None) -> int:
    """One line for one point of a multirun dry run: ``[ok] <label>`` or
    ``[error] <label>: <what to change>``. Returns the exit status of that point."""
    from depthmix.planning import dry_run
    from depthmix.pretrain.preflight import preflight

    world_size = dry_run.world_size_of(run) if world_size is None else world_size
    try:
        preflight(run, world_size)
    except ConfigError as e:
        print(f"[error] {label}: {e}", flush=True)
        return exit_codes.CONFIG_ERROR
    print(f"[ok] {label} (world size {world_size})", flush=True)
    return exit_codes.OK


def dry_run_points(points: Sequence[Point]) -> int:
    """Every point of a multirun dry run: one verdict line each; 2 if any fails."""
    from depthmix.config.load import resolve

    status = exit_codes.OK
    for point in points:
        point.cfg.output_dir = os.getcwd()  # no Hydra job, no output directory
        try:
            run = resolve(point.cfg)
        except ConfigError as e:
            print(f"[error] {point.label}: {e}", flush=True)
            status = exit_codes.CONFIG_ERROR
            continue
        status = max(status, dry_run_verdict(run, point.label))
    print(f"dry run: {len(points)} points, "
          f"{'all OK' if status == exit_codes.OK else f'some cannot run (exit {status})'}",
          flush=True)
    return status


def before_hydra(argv: Sequence[str]) -> Optional[int]:
    """The exit status when this is all ``depthmix-train`` does: help printed, or a
    multirun dry run's verdicts; None to let Hydra run. Raises :class:`ConfigError` for
    overrides Hydra would refuse."""
    if "--help" in argv or "-h" in argv:
        overrides = [a for a in argv if a not in ("--help", "-h", "-m", "--multirun")]
        points = compose_points(overrides, multirun="-m" in argv or "--multirun" in argv)
        print(help_text(points[0].cfg, overrides))
        return exit_codes.OK
    points = hydra_points(argv, "config")  # None: Hydra's own modes
    multirun = "-m" in argv or "--multirun" in argv
    if multirun and points and all(p.cfg.train.dry_run for p in points):
        return dry_run_points(points)
    return None
