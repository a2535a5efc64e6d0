"""The registry of depth mixers: ``mixer=<name>`` selects one.

A mixer is a folder (a package) beside this file, or in a folder on the search path:

* ``__init__.py``: the options (a :class:`MixerConfig` subclass), the depth plan, the cost
  hooks and ``MIXER`` (a :class:`Mixer`), or ``MIXERS`` (name -> Mixer) when one folder
  holds several variants of a method. It imports neither torch nor Megatron (``--help``
  and the dry run read it).
* ``model.py``: the Megatron modules and the model spec, imported when a model is built
  (:func:`~depthmix.mixers.base.model_hook`).

Every list of mixers (``--help``, the Hydra config store, the tools, the test matrices)
comes from :func:`available`. The search path: the folders in ``DEPTHMIX_MIXER_PATH``
(``os.pathsep``-separated; child processes inherit it), then those given to
:func:`register_search_path`. A mixer found there is imported as
``depthmix.mixers.<folder>``; its ``mixer=<name>`` config is generated from its config
class (the built-in mixers' YAML files are ``depthmix/configs/mixer/<name>.yaml``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pkgutil
from typing import Dict, List, Tuple

from depthmix import kernels
from depthmix.config.schema import ConfigError
from depthmix.config.validate import closest
from depthmix.mixers.base import CHECKS, Mixer, MixerConfig

BUILTIN = os.path.dirname(os.path.abspath(__file__))
YAML_DIR = os.path.join(os.path.dirname(BUILTIN), "configs", "mixer")
ENV_PATH = "DEPTHMIX_MIXER_PATH"
REQUIRED = ("config_cls", "model_spec", "plan")
"""The :class:`Mixer` fields without a default."""

_registered_paths: List[str] = []


def register_search_path(path: str) -> None:
    """Look for mixer folders in ``path`` too (this process only; for child processes
    set ``DEPTHMIX_MIXER_PATH``)."""
    path = os.path.abspath(path)
    if path not in _registered_paths:
        _registered_paths.append(path)
    _mount(search_path())


def search_path() -> Tuple[str, ...]:
    """The folders mixer packages are found in, the built-in one first."""
    extra = [os.path.abspath(p) for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p]
    return tuple(dict.fromkeys([BUILTIN, *extra, *_registered_paths]))


def _mount(path: Tuple[str, ...]) -> None:
    """``depthmix.mixers.<folder>`` imports from any folder on ``path`` (also when a child
    process unpickles a config of a mixer from the search path)."""
    if __path__ != list(path):
        __path__[:] = path
        importlib.invalidate_caches()


def available() -> List[str]:
    return sorted(_mixers())


def get_mixer(name: str) -> Mixer:
    mixers = _mixers()
    if name not in mixers:
        raise ConfigError(f"mixer={name!r} is unknown; choose one of {sorted(mixers)}"
                          f"{closest(name, mixers)}")
    return mixers[name]


def mixer_of(run) -> Mixer:
    """The :class:`Mixer` of a run config (vanilla when it names none), for the layers
    above the mixers to hand to those below (planning, the model), which never look one up."""
    return get_mixer(run.mixer.name if run.mixer is not None else "vanilla")


def has_yaml(name: str) -> bool:
    """Whether ``mixer=<name>`` is ``depthmix/configs/mixer/<name>.yaml`` (else the config
    store holds it, made from the config class: :func:`depthmix.config.store.register_configs`)."""
    return os.path.isfile(os.path.join(YAML_DIR, f"{name}.yaml"))


def _mixers() -> Dict[str, Mixer]:
    path = search_path()
    _mount(path)
    return _discover(path)


@functools.lru_cache(maxsize=None)
def _discover(path: Tuple[str, ...]) -> Dict[str, Mixer]:
    """Every mixer of the folders on ``path`` (mounted), each checked (:func:`_check`)."""
    found: Dict[str, Mixer] = {}
    homes: Dict[str, str] = {}
    for info in pkgutil.iter_modules(path):
        if not info.ispkg:
            continue
        where = os.path.join(info.module_finder.path, info.name, "__init__.py")
        if info.name in homes:
            raise ConfigError(f"mixer folder {where} has the name of {homes[info.name]}")
        homes[info.name] = where
        module = importlib.import_module(f"{__name__}.{info.name}")
        if os.path.abspath(module.__file__) != where:
            raise ConfigError(f"mixer folder {where}: depthmix.mixers.{info.name} is already "
                              f"imported from {module.__file__}")
        for mixer in _mixers_of(module, where):
            _check(mixer, where)
            if mixer.name in found:
                raise ConfigError(f"mixer {mixer.name!r} ({where}) is registered twice")
            found[mixer.name] = mixer
    return found


def _mixers_of(module, where: str) -> List[Mixer]:
    if hasattr(module, "MIXERS"):
        mixers = module.MIXERS
        for name, mixer in mixers.items():
            if not isinstance(mixer, Mixer) or mixer.name != name:
                raise ConfigError(f"{where}: MIXERS[{name!r}] must be a Mixer named {name!r}")
        return list(mixers.values())
    if not isinstance(getattr(module, "MIXER", None), Mixer):
        raise ConfigError(f"mixer folder {where} defines neither MIXER (a Mixer) nor MIXERS")
    return [module.MIXER]


def _check(mixer: Mixer, where: str) -> None:
    """Refuse a mixer that lacks what every mixer needs, naming what and where."""
    def refuse(what: str):
        raise ConfigError(f"mixer {mixer.name!r} ({where}) {what}")

    for hook in REQUIRED:
        if getattr(mixer, hook) is None:
            refuse(f"has no {hook}")
    if not (isinstance(mixer.config_cls, type) and issubclass(mixer.config_cls, MixerConfig)):
        refuse(f"config_cls {mixer.config_cls!r} is not a MixerConfig")
    unknown = set(mixer.kernels) - set(kernels.ops())
    if unknown:
        refuse(f"names kernel ops {sorted(unknown)} that depthmix/kernels/ lacks")
    module = getattr(mixer.model_spec, "module", None)
    if module is not None and importlib.util.find_spec(module) is None:
        refuse(f"has no {module} (its model_spec)")
    options = {f for f in mixer.config_cls.__dataclass_fields__}
    for variant in mixer.variants:
        unknown = set(variant.options) - options
        if unknown:
            refuse(f"variant {variant.name!r} sets unknown options {sorted(unknown)}")
        unknown = set(variant.checks) - set(CHECKS)
        if unknown:
            refuse(f"variant {variant.name!r} names checks {sorted(unknown)} (known: {CHECKS})")
    covered = {c for v in mixer.variants for c in v.checks}
    for check in CHECKS:
        if check not in covered and (check != "kernels" or mixer.kernels):
            refuse(f"has no variant for the {check!r} check")


_mount(search_path())
