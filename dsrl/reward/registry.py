"""Verifier registry. Every verifier has one signature:

    fn(completion_text: str, prompt: Prompt) -> float

and each prompt source names its default verifier (`source.default_verifier`); config key
`reward.fn` overrides it. A name is a registered verifier or a dotted path to a function.

A function may instead take the row's fields by name, as TRL's reward functions do:

    def reward(completion, answer, **row) -> float

It is told apart by its signature, once, when it is registered or loaded (before any model
loads): a function that takes `**kwargs` or names a parameter `answer`, `question`, `messages` or
`meta` is called with keyword arguments from the row (`row_fields`); any other must take two
positional arguments (completion_text, prompt), today's form. `as_verifier` turns either into the
one signature above.

The built-in verifiers register themselves when the package `dsrl.reward` is imported (its
__init__ imports them); this module imports none of them."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

from dsrl.registry import PluginError, Registry

Verifier = Callable[[str, Any], float]

# The fields a row-style function may name (besides the prompt's meta keys, e.g. `task`, `metadata`).
ROW_FIELDS = ("completion", "prompt", "answer", "question", "messages", "meta")
# A parameter of one of these names makes a function row-style (`completion` and `prompt` do not:
# fn(completion, prompt) is today's positional form and gets the same values either way).
ROW_MARKERS = ("answer", "question", "messages", "meta")


def row_fields(completion_text: str, prompt: Any) -> dict:
    """A row-style function's keyword arguments: the file row's own fields (meta["record"] of
    data=jsonl|parquet|hf), the prompt's meta keys, then `completion` (the text), `prompt` (the
    Prompt record), `answer`, `question` (meta's, else the last user message), `messages` and
    `meta` (later names win over earlier ones of the same name)."""
    meta = dict(getattr(prompt, "meta", {}) or {})
    record = meta.get("record")
    row = dict(record) if isinstance(record, dict) else {}
    row.update(meta)
    row.update(completion=completion_text, prompt=prompt, answer=getattr(prompt, "answer", None),
               question=meta.get("question", getattr(prompt, "text", None)),
               messages=getattr(prompt, "messages", None), meta=meta)
    return row


class RowVerifier:
    """A function that takes the row's fields by name, called as fn(completion_text, prompt)."""

    def __init__(self, fn: Callable, params: dict):
        self.fn = fn
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.names = [n for n, p in params.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        self.required = [n for n in self.names if params[n].default is inspect.Parameter.empty]
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, completion_text: str, prompt: Any) -> float:
        row = row_fields(completion_text, prompt)
        missing = [n for n in self.required if n not in row]
        if missing:
            raise TypeError(f"reward function {self.__name__} takes {missing}, which this row lacks; the row's "
                            f"fields are {sorted(row)}")
        kwargs = row if self.takes_all else {n: row[n] for n in self.names if n in row}
        return self.fn(**kwargs)

    def __repr__(self) -> str:
        return f"RowVerifier({self.__name__})"


def as_verifier(obj: Any, path: str = "") -> Verifier:
    """`obj` as fn(completion_text, prompt) -> float, decided by its signature (once)."""
    what = path or getattr(obj, "__name__", repr(obj))
    if not callable(obj):
        raise TypeError(f"a verifier must be a function fn(completion_text, prompt) -> float or "
                        f"fn(completion, answer, **row) -> float; {what} is not callable")
    if isinstance(obj, RowVerifier):
        return obj
    try:
        params = dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the positional pair
        return obj
    sig = inspect.signature(obj)
    if "completions" in params:
        raise TypeError(f"{what}{sig} takes `completions`, a batch: dsrl scores one completion per call; name "
                        f"the parameter `completion` (the text; other fields by name: {', '.join(ROW_FIELDS)})")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or any(n in params for n in ROW_MARKERS):
        positional_only = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        if positional_only:
            raise TypeError(f"{what}{sig}: a function that takes the row's fields by name cannot have "
                            f"positional-only parameters ({positional_only})")
        return RowVerifier(obj, params)
    try:
        sig.bind("", None)
    except TypeError:
        raise TypeError(f"{what}{sig}: a verifier takes two positional arguments (completion_text, prompt), or "
                        f"the row's fields by name: a **kwargs or a parameter named {' / '.join(ROW_MARKERS)} "
                        f"(fields: {', '.join(ROW_FIELDS)} and the prompt's meta keys)") from None
    return obj


VERIFIERS = Registry("verifier", wrap=as_verifier)


def register_verifier(name: str) -> Callable[[Any], Any]:
    """Decorator: `@register_verifier("name")` on either kind of function; the function itself is
    returned unchanged."""
    def deco(fn: Any) -> Any:
        VERIFIERS.add(name, as_verifier(fn, name))
        return fn
    return deco


def strict(fn: Verifier) -> Verifier:
    """reward.strict: a score strictly between 0 and 1 (partial credit) becomes 0."""
    def strict_score(completion_text: str, prompt: Any) -> float:
        value = float(fn(completion_text, prompt))
        return 0.0 if 0.0 < value < 1.0 else value
    strict_score.__name__ = f"strict({getattr(fn, '__name__', repr(fn))})"
    return strict_score


def verifier_names() -> list[str]:
    return sorted(VERIFIERS)


def get_verifier(name: str, key: str = "reward.fn") -> Verifier:
    """A registered verifier, or a function loaded from a dotted path; errors name `key`."""
    return VERIFIERS.resolve(name, key)


def verifier_for_source(source: Any, override: Optional[str] = None) -> Verifier:
    """The verifier named by `override` (config key reward.fn), else the source's
    `default_verifier`."""
    if override:
        return get_verifier(override, "reward.fn")
    name = getattr(source, "default_verifier", None)
    if not name:
        raise PluginError(f"reward.fn: prompt source {source!r} names no default verifier; set reward.fn to one "
                          f"of {verifier_names()} or a dotted path 'pkg.module.fn'")
    return get_verifier(name, f"{type(source).__name__}.default_verifier")


def build_verifier(reward_cfg: Any, source: Any) -> Verifier:
    """The run's verifier: the reward server at `reward.url`, else `reward.fn`, else the
    source's default; partial credit turned into 0 under `reward.strict`."""
    if getattr(reward_cfg, "url", None):
        from dsrl.reward.http import RemoteReward

        fn = RemoteReward(reward_cfg.url, timeout_s=reward_cfg.timeout_s, retries=reward_cfg.retries)
    else:
        fn = verifier_for_source(source, reward_cfg.fn)
    return strict(fn) if getattr(reward_cfg, "strict", False) else fn


def build_eval_verifier(reward_cfg: Any, source: Any) -> Optional[Verifier]:
    """The greedy eval's verifier: `reward.eval_fn` (under `reward.strict` too), or None: the
    training reward's."""
    if not getattr(reward_cfg, "eval_fn", None):
        return None
    fn = verifier_for_source(source, reward_cfg.eval_fn)
    return strict(fn) if getattr(reward_cfg, "strict", False) else fn


def score(fn: Verifier, completions: Sequence[str], prompts: Sequence[Any]) -> list[float]:
    """Score completions against their prompts (same length, aligned)."""
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions vs {len(prompts)} prompts")
    return [float(fn(c, p)) for c, p in zip(completions, prompts)]
