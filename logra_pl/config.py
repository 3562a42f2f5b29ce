"""The one resolver of plug-in names: a short name, a dotted path, a ``{class_path, init_args}`` mapping, or an object.

Every kind of plug-in a config chooses by name — losses, advantage baselines, update methods, rollout engines — keeps
a :class:`Registry` on its base class. A built-in class registers its own short names with :func:`register` (the way
Lightning's strategies name themselves), so adding one is one class in one file; :func:`resolve` turns whatever a
config or a caller gives into the object::

    loss: ppo                                                   # a short name (the class with its defaults)
    loss: PPOClip                                               # a registered class by its own name
    loss: my_pkg.losses.MyLoss                                  # a dotted path: a class (built with its defaults)
    loss: {class_path: logra_pl.losses.PPOClip, init_args: {clip_eps: 0.1}}

and in Python any object of the kind is used as it is. What a name resolves to is checked by the registry's own check
(``check_loss`` and the like), so a wrong object fails with a message naming the setting, not deep in a run.

Old spellings (the deprecated ``{kind: ...}`` sections, the short ``optimizer:`` form) are not known here either: the
places where configs and checkpoints are read pass them through :func:`translated`, and whoever knows an old spelling
adds its translator there (:func:`add_translator`: ``logra_pl/_graveyard`` does, from outside, when the package is
imported). Without translators every value passes unchanged.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from logra_pl.errors import ConfigError

T = TypeVar("T")


def import_dotted(path: str, setting: str) -> Any | None:
    """The object a dotted path ``package.module.NAME`` names (a config's way to pick user code); None if ``path``
    has no dot. An import that fails is a :class:`ConfigError` naming ``setting`` and the import error."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        return None
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{setting} {path!r}: cannot import it ({err})") from None


def class_path_of(obj: Any) -> str:
    """The shortest dotted path that imports ``obj`` (a class or function; else the object's class), as jsonargparse
    writes it: ``logra_pl.losses.PPOClip``, not the file it is defined in."""
    named = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    module, qualname = named.__module__, named.__qualname__
    if "." not in qualname:
        parts = module.split(".")
        for k in range(1, len(parts)):
            head = ".".join(parts[:k])
            try:
                if getattr(importlib.import_module(head), qualname, None) is named:
                    return f"{head}.{qualname}"
            except ImportError:
                continue
    return f"{module}.{qualname}"


class Registry:
    """The short names of one kind of plug-in, and how to resolve that kind.

    Arguments:
        kind: what the plug-ins are, for messages (``"loss"``).
        setting: the config key that chooses one (``"model.loss"``).
        example: a ``class_path`` to suggest in messages.
        check: raises :class:`ConfigError` unless an object has the kind's whole contract (None: no check).
    """

    def __init__(self, kind: str, setting: str, example: str, check: Callable[[Any, str], None] | None = None) -> None:
        self.kind, self.setting, self.example, self.check = kind, setting, example, check
        self.names: dict[str, Any] = {}

    def add(self, name: str, target: Any) -> Any:
        """Make ``target`` (a class, a function, an object, or the dotted path of one) available as ``name``;
        registering a name again replaces it."""
        self.names[name] = target
        return target

    def lookup(self, name: str, setting: str) -> Any | None:
        """What ``name`` names: a registered short name, or a registered class by its own name; None otherwise. A
        target registered as a dotted path is imported now."""
        target = self.names.get(name)
        if target is None:
            target = next((t for t in self.names.values() if inspect.isclass(t) and t.__name__ == name), None)
        if isinstance(target, str):
            target = import_dotted(target, setting)
        return target

    def unknown(self, name: str, setting: str) -> ConfigError:
        """The error for a name that resolves to nothing: the choices and the other forms."""
        names = ", ".join(repr(k) for k in self.names)
        return ConfigError(
            f"unknown {setting} {name!r}: use one of {names}, a class_path such as {self.example}, or the dotted path "
            "of your own class"
        )


def registry_of(cls: type) -> Registry:
    """The registry of ``cls``'s kind: the ``registry`` of its nearest base class that defines one."""
    for base in cls.__mro__:
        found = vars(base).get("registry")
        if isinstance(found, Registry):
            return found
    raise TypeError(f"{cls.__qualname__} is not a kind of plug-in with a registry")


def register(*names: str) -> Callable[[T], T]:
    """Class decorator: ``@register("ppo")`` makes the class available by each of ``names`` in its kind's registry."""

    def add(cls: T) -> T:
        registry = registry_of(cls)  # type: ignore[arg-type]
        for name in names:
            registry.add(name, cls)
        return cls

    return add


def flow(value: Any) -> str:
    """A value as YAML flow text (``{class_path: x, init_args: {a: 1}}``), for messages."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def init_parameters(cls: type) -> tuple[list[inspect.Parameter], bool]:
    """The named parameters of ``cls``'s constructor, a ``**kwargs`` followed into the base classes' constructors (as
    jsonargparse reads them: ``**shared`` passed on to ``super().__init__``), and whether the last one reached still
    takes any keyword."""
    out: list[inspect.Parameter] = []
    for owner in cls.__mro__:
        init = vars(owner).get("__init__")
        if init is None or owner is object:
            continue
        params = list(inspect.signature(init).parameters.values())
        out += [p for p in params if p.kind in _NAMED and p.name != "self" and p.name not in {q.name for q in out}]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return out, False
    return out, True


def construct(cls: type, init_args: Mapping[str, Any] | None, setting: str) -> Any:
    """``cls(**init_args)``; arguments it does not take are a :class:`ConfigError` listing those it does."""
    init_args = dict(init_args or {})
    params, takes_any = init_parameters(cls)
    unknown = sorted(set(init_args) - {p.name for p in params})
    if unknown and not takes_any:
        raise ConfigError(
            f"{setting}: {class_path_of(cls)} does not take {', '.join(map(repr, unknown))}; its "
            f"arguments are {', '.join(p.name for p in params) or 'none'}"
        )
    return cls(**init_args)


def build_class_path(spec: Any, setting: str) -> Any:
    """The object a ``{class_path, init_args}`` mapping describes, built the way jsonargparse builds one outside a
    parsed config (a verifier combining verifiers, a logger entry): ``init_args`` values that are themselves such
    mappings are built first, so they nest. Anything else is returned as it is. Every failure is a
    :class:`ConfigError` that names ``setting``: unknown keys, a class path that does not import, arguments the class
    does not take."""
    if not (isinstance(spec, Mapping) and "class_path" in spec):
        return spec
    unknown = set(spec) - {"class_path", "init_args"}
    if unknown:
        raise ConfigError(f"{setting} has unknown keys {sorted(unknown)}: use class_path and init_args")
    class_path, init_args = spec["class_path"], spec.get("init_args") or {}
    if not isinstance(class_path, str) or "." not in class_path:
        raise ConfigError(f"{setting} class_path must be a dotted 'module.Class' string, got {class_path!r}")
    if not isinstance(init_args, Mapping):
        raise ConfigError(f"{setting} init_args for {class_path} must be a mapping, got {init_args!r}")
    cls = import_dotted(class_path, setting)
    built = {key: build_class_path(value, f"{setting}.init_args.{key}") for key, value in init_args.items()}
    try:
        return construct(cls, built, setting) if inspect.isclass(cls) else cls(**built)
    except TypeError as err:
        raise ConfigError(f"{setting}: cannot build {class_path} with init_args {dict(init_args)!r}: {err}") from err


def _default_build(target: Any, name: str) -> Any:
    """A class is built with its defaults; anything else is used as it is."""
    return target() if inspect.isclass(target) else target


def _mapping(text: str, setting: str) -> Mapping[str, Any]:
    """A mapping given as text on the command line (one jsonargparse could not take as an object)."""
    import yaml

    try:
        mapping = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{setting} {text!r} is not a valid mapping: {err}") from None
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{setting} {text!r} is not a mapping")
    return mapping


def resolve(
    value: Any,
    registry: Registry,
    setting: str | None = None,
    build: Callable[[Any, str], Any] = _default_build,
) -> Any:
    """The plug-in ``value`` names, checked by the registry.

    Arguments:
        value: a short name or a registered class's name; a dotted path (to a class, built by ``build``, or to an
            object); a ``{class_path, init_args}`` mapping (also as text); or an object, used as it is.
        registry: the kind's registry.
        setting: the config key, for messages (default: the registry's).
        build: turns what a name or path gives (a class, or a registered function or object) into the plug-in;
            default: a class is built with its defaults, anything else is used as it is.
    """
    setting = setting or registry.setting
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            return resolve(_mapping(text, setting), registry, setting, build)
        target = registry.lookup(text, setting)
        if target is None:
            target = import_dotted(text, setting)
            if target is None:
                raise registry.unknown(text, setting)
        value = build(target, text)
    elif isinstance(value, Mapping):
        if "class_path" not in value:
            flags = " ".join(f"--{setting}.{k} {flow(v)}" for k, v in value.items())
            raise ConfigError(
                f"{setting} {flow(dict(value))} gives arguments but no class_path. A short name takes none: name the "
                f"class instead (--{setting} CLASS {flags}, or {setting.rpartition('.')[2]}: {{class_path: CLASS, "
                "init_args: {...}})"
            )
        path = str(value["class_path"])
        cls = registry.lookup(path, setting) or import_dotted(path, setting)
        if not inspect.isclass(cls):
            raise ConfigError(f"{setting} class_path {path!r} is not a class")
        value = construct(cls, value.get("init_args"), setting)
    if registry.check is not None:
        registry.check(value, setting)
    return value


# ------------------------------------------------------------------------------------------ older spellings
# Where settings are read -> the translators of older spellings, in the order they were added.
TRANSLATION_POINTS = ("config", "argv", "settings", "setting", "hparams", "checkpoint", "plugin")
_TRANSLATORS: dict[str, list[Callable[..., Any]]] = {point: [] for point in TRANSLATION_POINTS}


def add_translator(point: str, translator: Callable[..., Any]) -> None:
    """Translate older spellings at ``point`` (once per translator):

    - ``"config"``: ``translator(config) -> config``, a whole parsed YAML config or command-line value (the CLI);
    - ``"argv"``: ``translator(args) -> args``, the CLI's command-line arguments before they are parsed;
    - ``"settings"``: ``translator(settings) -> settings``, a run's plain nested settings as a resume compares them
      (quietly: the run is not told about a checkpoint's spelling);
    - ``"setting"``: ``translator(value, key) -> value``, one ``model.<key>`` setting as a resume compares it;
    - ``"hparams"``: ``translator(hparams) -> hparams``, a checkpoint's saved module hyper-parameters
      (``load_from_checkpoint``);
    - ``"checkpoint"``: ``translator(checkpoint) -> checkpoint``, a loaded checkpoint before the module reads it;
    - ``"plugin"``: ``translator(value, registry, setting) -> value``, what a setting names before :func:`resolve`
      reads it (an object of an older kind, a name an older registry gave).
    """
    if point not in _TRANSLATORS:
        raise ValueError(f"unknown translation point {point!r}: use one of {', '.join(TRANSLATION_POINTS)}")
    if translator not in _TRANSLATORS[point]:
        _TRANSLATORS[point].append(translator)


def translated(point: str, value: T, *args: Any) -> T:
    """``value`` with the older spellings the translators at ``point`` know written the current way (unchanged when
    none is attached)."""
    for translator in _TRANSLATORS[point]:
        value = translator(value, *args)
    return value


def as_settings(cls: type[T], value: T | Mapping[str, Any] | None, setting: str) -> T:
    """A settings dataclass from what a caller gives: an instance as it is, a mapping of its fields (a config's
    ``init_args`` read without jsonargparse, e.g. ``model.method`` given as a ``{class_path, init_args}`` dict in
    Python), or None for its defaults. A key it does not have is a :class:`ConfigError` naming ``setting``."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return construct(cls, value, setting)
    raise ConfigError(f"{setting}: expected {cls.__name__} or a mapping of its fields, got {type(value).__name__}")
