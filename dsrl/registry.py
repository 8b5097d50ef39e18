"""Name -> plug-in registries and dotted-path loading: one implementation for every registry
(objectives, advantage estimators, corrections, prompt sources, verifiers, hooks)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


class Registry(dict):
    """A dict of name -> item that refuses duplicate names and names the known ones on a miss."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

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
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
        return self[name]


def load_callable(path: str, key: str) -> Callable:
    """Import `pkg.mod.fn` or `pkg.mod:fn`; errors name the config `key` that gave the path."""
    mod_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"{key}: {path!r} is not a dotted path 'pkg.module.fn'")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot load {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} does not name a callable")
    return fn
