"""Prompt sources behind a name -> class registry. A source implements:

    sample_train(n, rng) -> list[Prompt]   # training prompts drawn with `rng`
    eval_set(n) -> list[Prompt]            # held out, disjoint from training, deterministic

and names its default verifier (`default_verifier`: a verifier name or a dotted path).

The built-in sources register themselves when the package `dsrl.data` is imported (its
__init__ imports them); this module imports none of them. `data.name` may also be a dotted path
to a source class (`pkg.module.MySource`).
"""
from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import asdict, is_dataclass
from typing import Any, Callable, Mapping, Protocol, Union

from dsrl.data.types import Prompt
from dsrl.registry import Registry

RngLike = Union[random.Random, int, None, Any]


class PromptSource(Protocol):
    name: str
    default_verifier: str

    def sample_train(self, n: int, rng: RngLike) -> list[Prompt]: ...

    def eval_set(self, n: int) -> list[Prompt]: ...


def source_metrics(source: Any) -> dict:
    """A source's own step metrics (e.g. `data/skipped_rows` of the file sources); `metrics()` is
    an optional part of the PromptSource protocol."""
    fn = getattr(source, "metrics", None)
    return dict(fn()) if callable(fn) else {}


def _source_class(obj: Any, path: str) -> type:
    """A source named by dotted path must be a class with the PromptSource methods."""
    missing = [m for m in ("sample_train", "eval_set") if not callable(getattr(obj, m, None))]
    if not inspect.isclass(obj) or missing:
        raise TypeError("a prompt source must be a class with sample_train(n, rng) and eval_set(n)"
                        + (f" (missing: {missing})" if inspect.isclass(obj) else ""))
    return obj


SOURCES = Registry("prompt source", wrap=_source_class)


def register_source(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        return SOURCES.add(name, cls)
    return deco


def source_names() -> list[str]:
    return sorted(SOURCES)


def source_class(name: str) -> type:
    """The class of source `name` (registered, or a dotted path); errors name `data.name`."""
    return SOURCES.resolve(name, "data.name")


def make_source(name: str, **kwargs: Any) -> PromptSource:
    """Instantiate a registered (or dotted-path) source; keyword arguments its constructor does
    not take are ignored (so a whole `data` config section can be passed)."""
    cls = source_class(name)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = kwargs
    else:
        accepted = {k: v for k, v in kwargs.items() if k in params and k != "self"}
    return cls(**accepted)


def _as_mapping(cfg: Any) -> dict:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if is_dataclass(cfg):
        return asdict(cfg)
    with contextlib.suppress(ImportError):  # omegaconf DictConfig, imported only when needed
        from omegaconf import DictConfig, OmegaConf
        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))
    return {k: getattr(cfg, k) for k in dir(cfg) if not k.startswith("_")}


def build_source(data_cfg: Any) -> PromptSource:
    """Build the source named by `data_cfg.name` from a `data` config section (dataclass,
    DictConfig or mapping)."""
    d = _as_mapping(data_cfg)
    name = d.pop("name", "arith")
    return make_source(name, **d)


def as_random(rng: RngLike) -> random.Random:
    """Accept a random.Random, an int seed, None (seed 0) or a numpy Generator."""
    if isinstance(rng, random.Random):
        return rng
    if rng is None:
        return random.Random(0)
    if isinstance(rng, int):
        return random.Random(rng)
    if hasattr(rng, "integers"):  # numpy.random.Generator: derive a seed from it
        return random.Random(int(rng.integers(0, 2**63 - 1)))
    raise TypeError(f"rng must be random.Random, int, None or numpy Generator, not {type(rng)}")


class PromptStream:
    """The training prompt stream of a run: a source plus a seeded RNG whose state can be
    checkpointed, so a resumed run continues the same stream."""

    def __init__(self, source: PromptSource, seed: int = 0):
        self.source = source
        self.seed = seed
        self.rng = random.Random(seed)
        self.num_drawn = 0

    def next(self, n: int) -> list[Prompt]:
        out = self.source.sample_train(n, self.rng)
        self.num_drawn += len(out)
        return out

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"seed": self.seed, "num_drawn": self.num_drawn,
                "rng_state": [version, list(internal), gauss]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["rng_state"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.seed = state.get("seed", self.seed)
        self.num_drawn = int(state.get("num_drawn", 0))
