"""The one place that decides machine-dependent settings.

A config value of ``auto`` (or ``null`` / ``0`` where the schema says so) is resolved here from a
`Machine` description, with a one-line reason per decision. `decide` is pure (tests pass made-up
machines); `probe` reads the real one. Explicit config values are never overridden.

Why it matters: on a CPU without native bf16 (e.g. an AVX2-only EPYC) bf16 is emulated and the
default job ran ~20x slower than in float32; with AMX or AVX512-BF16 bf16 is the faster choice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, FrozenSet, List, Optional

__all__ = ["Machine", "Decision", "probe", "decide", "apply", "record_resolved", "describe",
           "cpu_has_native_bf16", "cpu_core_range", "local_world_size"]

# /proc/cpuinfo flags of instructions that compute bf16 natively (matmul kernels use them).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Machine:
    """What the decisions depend on."""
    cpu_flags: FrozenSet[str] = frozenset()
    cpu_count: int = 1
    cuda: bool = False
    cuda_bf16: bool = False  # the CUDA device computes bf16 natively (Ampere and later)
    local_ranks: int = 1     # trainer processes sharing this machine's cores
    cpu_model: str = ""


@dataclass(frozen=True)
class Decision:
    key: str        # dotted config key, e.g. "model.dtype"
    value: Any      # the value the run uses
    reason: str     # one line: why this value
    auto: bool      # True when decided here, False when the config set it explicitly
    warning: str = ""  # set when an explicit value is a poor fit for this machine

    def line(self) -> str:
        text = f"{self.key}={self.value} ({'auto: ' if self.auto else ''}{self.reason})"
        return f"{text}; {self.warning}" if self.warning else text


def _cpu_flags(cpuinfo: str) -> FrozenSet[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def probe(local_ranks: int = 1, cpuinfo_path: str = "/proc/cpuinfo") -> Machine:
    """Describe this machine: CPU flags (from /proc/cpuinfo), usable cores, CUDA and its bf16."""
    import torch

    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            cpuinfo = f.read()
    except OSError:  # no /proc (macOS): no flags known, so no bf16 assumed
        cpuinfo = ""
    cuda = torch.cuda.is_available()
    return Machine(cpu_flags=_cpu_flags(cpuinfo), cpu_count=_usable_cores(), cuda=cuda,
                   cuda_bf16=bool(cuda and torch.cuda.is_bf16_supported()),
                   local_ranks=max(1, int(local_ranks)), cpu_model=_cpu_model(cpuinfo))


def cpu_has_native_bf16(m: Machine) -> bool:
    return any(flag in m.cpu_flags for flag in BF16_CPU_FLAGS)


def _bf16_verdict(m: Machine) -> tuple[bool, str]:
    if m.cuda:
        if m.cuda_bf16:
            return True, "CUDA device computes bf16 natively"
        return False, "CUDA device has no native bf16"
    found = [flag for flag in BF16_CPU_FLAGS if flag in m.cpu_flags]
    if found:
        return True, f"CPU has {'/'.join(found)}, bf16 is native"
    return False, "CPU has no AMX/AVX512-BF16, bf16 would be emulated"


def _dtype(key: str, value: str, m: Machine) -> Decision:
    native, why = _bf16_verdict(m)
    if value != "auto":
        if value == "bfloat16" and not native:
            return Decision(key, value, "set in config", auto=False, warning=f"{why}: expect a slow run")
        return Decision(key, value, "set in config", auto=False)
    return Decision(key, "bfloat16" if native else "float32", why, auto=True)


def decide(cfg, m: Machine) -> List[Decision]:
    """One decision per machine-dependent key of `cfg` (a typed Config); reads, never writes."""
    out = [_dtype("model.dtype", cfg.model.dtype, m), _dtype("rollout.dtype", cfg.rollout.dtype, m)]

    attn = cfg.model.attn_implementation
    if attn != "auto":
        out.append(Decision("model.attn_implementation", attn, "set in config", auto=False))
    elif m.cuda:
        out.append(Decision("model.attn_implementation", "sdpa", "CUDA: fused SDPA kernels", auto=True))
    else:
        out.append(Decision("model.attn_implementation", "eager",
                            "CPU: ~2x faster than sdpa with a padding mask", auto=True))

    eager = cfg.rollout.enforce_eager
    if eager is not None:
        out.append(Decision("rollout.enforce_eager", bool(eager), "set in config", auto=False))
    elif m.cuda:
        out.append(Decision("rollout.enforce_eager", False, "CUDA: capture CUDA graphs", auto=True))
    else:
        out.append(Decision("rollout.enforce_eager", True, "CPU: no CUDA graphs, eager starts fastest", auto=True))

    threads = cfg.actor.num_threads
    if threads < 0:
        from dsrl.config.reuse import ConfigError

        raise ConfigError(f"actor.num_threads={threads} must be >= 0 (0 = auto)")
    if threads:
        out.append(Decision("actor.num_threads", int(threads), "set in config", auto=False))
    else:
        n = max(1, m.cpu_count // max(m.local_ranks, 1))
        out.append(Decision("actor.num_threads", n,
                            f"{m.cpu_count} usable cores / {m.local_ranks} local rank(s)", auto=True))
    return out


def apply(cfg, decisions: List[Decision]):
    """Fill every decided value into the typed `cfg` (in place); returns it."""
    for d in decisions:
        section, _, leaf = d.key.partition(".")
        setattr(getattr(cfg, section), leaf, d.value)
    return cfg


def record_resolved(cfg_node, decisions: List[Decision]) -> None:
    """Write the resolved values into the Hydra node, so the saved config.yaml holds what ran."""
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg_node):
        for d in decisions:
            OmegaConf.update(cfg_node, d.key, d.value, merge=False)


def describe(m: Machine) -> str:
    """One line: what was probed."""
    flags = [f for f in BF16_CPU_FLAGS + ("avx512f", "avx2") if f in m.cpu_flags]
    cuda = ("CUDA with bf16" if m.cuda_bf16 else "CUDA without bf16") if m.cuda else "no CUDA"
    model = f"{m.cpu_model}, " if m.cpu_model else ""
    return (f"machine: {model}{m.cpu_count} usable cores, CPU flags [{' '.join(flags) or 'none of interest'}], "
            f"{cuda}, {m.local_ranks} local rank(s)")


def cpu_core_range(cpu_count: int, local_rank: int, local_world: int) -> str:
    """The cores ("lo-hi") a rank's vLLM engine binds to: an even share per local rank."""
    per = max(1, cpu_count // max(local_world, 1))
    lo = (local_rank * per) % max(cpu_count, 1)
    return f"{lo}-{lo + per - 1}" if per > 1 else f"{lo}"


def local_world_size(default: Optional[int] = None) -> int:
    """Trainer processes on this node, from the launcher's environment."""
    raw = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    if raw:
        try:
            return max(1, int(raw))
        except ValueError as exc:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE/LOCAL_SIZE={raw!r} is not an integer") from exc
    return max(1, default or 1)
