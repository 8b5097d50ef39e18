"""Load one textarena (0.6.3) game class offline.

`import textarena` runs the package's __init__, which imports its utilities (word lists through
`nltk`, an online API client), optional dependencies dsrl does not install. The game modules
themselves need only `textarena.core`. When the full import fails, this loader registers an
empty package shell for `textarena` and `textarena.envs` (their __init__ files are not run),
fills the shell with the names game modules use from it (`ta.Env`, `ta.State`, `ta.GAME_ID`, ...;
all from the real `textarena.core`), and imports the game module from the installed package."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types


def _shell(name: str, path: str) -> types.ModuleType:
    """An empty package module for `name` at `path`, with a real spec (importlib.util.find_spec
    and dsrl.packaged, which locate textarena's data files, read it)."""
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = [path]
    mod.__path__ = [path]
    mod.__package__ = name
    sys.modules[name] = mod
    return mod


def _ensure_textarena() -> None:
    if "textarena" in sys.modules:
        return
    try:
        importlib.import_module("textarena")
        return
    except ImportError:
        pass  # optional dependencies missing: fall back to the shell below
    spec = importlib.util.find_spec("textarena")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("rollout.env: the textarena package is not installed (pip install textarena==0.6.3 --no-deps)")
    root = list(spec.submodule_search_locations)[0]
    pkg = _shell("textarena", root)
    try:
        core = importlib.import_module("textarena.core")
        for name in ("Env", "Wrapper", "ObservationWrapper", "RenderWrapper", "ActionWrapper", "Agent",
                     "AgentWrapper", "State", "Message", "Observations", "Rewards", "Info", "GAME_ID"):
            if hasattr(core, name):
                setattr(pkg, name, getattr(core, name))
        pkg.core = core
        pkg.envs = _shell("textarena.envs", os.path.join(root, "envs"))
    except Exception:
        for name in [m for m in sys.modules if m == "textarena" or m.startswith("textarena.")]:
            del sys.modules[name]
        raise


def load_game(module: str, cls: str):
    """The class `cls` from `textarena.envs.<module>.env` (e.g. "GuessTheNumber", "GuessTheNumberEnv")."""
    _ensure_textarena()
    try:
        mod = importlib.import_module(f"textarena.envs.{module}.env")
    except ImportError as e:
        raise ImportError(f"rollout.env: textarena game {module!r} needs a package that is not installed: {e}") from e
    return getattr(mod, cls)
