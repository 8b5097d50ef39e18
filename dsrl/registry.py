"""Name -> plug-in registries and dotted-path loading: one implementation for every registry
(objectives, advantage estimators, corrections, prompt sources, verifiers, hooks).

Built-in plug-ins register themselves when their *package* is imported (dsrl/loss/__init__.py
imports the objective modules, and so on); a registry module never imports a plug-in, so there
is no import circle. A config may also name a plug-in that is not registered by its dotted path
(`pkg.module.attr` or `pkg.module:attr`); `Registry.resolve` loads it on first use."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional


class PluginError(KeyError, ValueError):
    """An unknown plug-in name or an unloadable dotted path; the message names the config key.

    A KeyError for callers that treat an unknown name as a missing key, a ValueError for those
    that treat it as a bad value; `str()` is the plain message (KeyError would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def is_dotted_path(name: Any) -> bool:
    """A name meant as an import path rather than a registry key: `pkg.mod.attr` or `mod:attr`
    (registered names are looked up first, so a registered `tinker:ppo` never gets here)."""
    return isinstance(name, str) and ("." in name or ":" in name)


class Registry(dict):
    """A dict of name -> item that refuses duplicate names and names the known ones on a miss.

    `wrap(obj, path)` turns an object loaded by dotted path into a registry item (e.g. a
    function into an ObjectiveSpec) and raises ValueError if `obj` cannot be one."""

    def __init__(self, kind: str, wrap: Optional[Callable[[Any, str], Any]] = None):
        super().__init__()
        self.kind = kind
        self.wrap = wrap
        self._by_path: dict = {}  # dotted path -> wrapped item, loaded once

    def add(self, name: str, item: Any) -> Any:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self[name] = item
        return item

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: `@REGISTRY.register("name")`."""
        def deco(item: Any) -> Any:
            self.add(name, item)
            return item
        return deco

    def get_or_raise(self, name: str) -> Any:
        if name not in self:
            raise PluginError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
        return self[name]

    def resolve(self, name: str, key: str) -> Any:
        """The item registered as `name`, else the object at dotted path `name` (wrapped).
        Errors name the config `key` that gave `name`."""
        if name in self:
            return self[name]
        if not is_dotted_path(name):
            raise PluginError(f"{key}={name!r}: unknown {self.kind}; registered: {sorted(self)}, "
                              f"or a dotted path 'pkg.module.attr'")
        if name not in self._by_path:
            obj = load_object(name, key)
            if self.wrap is not None:
                try:
                    obj = self.wrap(obj, name)
                except (TypeError, ValueError) as e:
                    raise PluginError(f"{key}={name!r}: not a usable {self.kind}: {e}") from e
            self._by_path[name] = obj
        return self._by_path[name]


def load_object(path: str, key: str) -> Any:
    """Import `pkg.mod.attr` or `pkg.mod:attr`; errors name the config `key` that gave the path."""
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise PluginError(f"{key}: {path!r} is not a dotted path 'pkg.module.attr'")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the plug-in module itself failing: name the key
        raise PluginError(f"{key}: cannot load {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise PluginError(f"{key}: cannot load {path!r}: module {mod_name!r} has no attribute {attr!r}") from e


def load_callable(path: str, key: str) -> Callable:
    """Import `pkg.mod.fn` or `pkg.mod:fn`; errors name the config `key` that gave the path."""
    fn = load_object(path, key)
    if not callable(fn):
        raise PluginError(f"{key}: {path!r} does not name a callable")
    return fn
