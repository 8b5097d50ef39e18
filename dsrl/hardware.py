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
from typing import Any, FrozenSet, List, Optional, Sequence

__all__ = ["Machine", "Decision", "probe", "decide", "apply", "record_resolved", "describe",
           "cpu_has_native_bf16", "cpu_core_range", "parse_core_list", "usable_core_ids", "local_world_size", "kernel_isa_cap"]

# /proc/cpuinfo flags of instructions that compute bf16 natively (matmul kernels use them).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

# oneDNN, which runs the CPU's bf16 matmuls, can be told to use less than the CPU has (to try
# another kernel path on one machine): ONEDNN_MAX_CPU_ISA. Under such a cap bf16 matmuls are
# emulated even on an AMX CPU. Its ISAs from low to high (lower-case; aliases side by side), and
# per bf16 flag the lowest ISA with which oneDNN uses that instruction. (ATen's ATEN_CPU_CAPABILITY
# caps only its element-wise kernels; bf16 matmuls stay native under it.)
_ONEDNN_ISA_ORDER = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
                     "avx512_core_bf16", "avx10_1_512", "avx512_core_fp16", "avx10_1_512_amx",
                     "avx512_core_amx", "avx10_1_512_amx_fp16", "avx512_core_amx_fp16", "default")
_ONEDNN_NEEDS = {"avx512_bf16": "avx512_core_bf16", "amx_bf16": "avx10_1_512_amx"}


@dataclass(frozen=True)
class Machine:
    """What the decisions depend on."""
    cpu_flags: FrozenSet[str] = frozenset()
    cpu_count: int = 1
    cuda: bool = False
    cuda_bf16: bool = False  # the CUDA device computes bf16 natively (Ampere and later)
    local_ranks: int = 1     # trainer processes sharing this machine's cores
    cpu_model: str = ""
    # Set when ONEDNN_MAX_CPU_ISA keeps the matmul kernels below the CPU's flags:
    # the bf16 flags that cap hides, and the setting that hides them (for the reason line).
    isa_cap: str = ""
    capped_flags: FrozenSet[str] = frozenset()


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


def usable_core_ids() -> List[int]:
    """The cores this process may run on (its affinity: a cpuset, `taskset`), sorted."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def kernel_isa_cap(flags: FrozenSet[str], onednn_max_isa: str = "") -> FrozenSet[str]:
    """The bf16 flags of `flags` that oneDNN does not use under ONEDNN_MAX_CPU_ISA=`onednn_max_isa`;
    pure. Unset, "default" or a value oneDNN does not know (it ignores those) hides nothing."""
    isa = onednn_max_isa.strip().lower()
    if isa not in _ONEDNN_ISA_ORDER:
        return frozenset()
    rank = _ONEDNN_ISA_ORDER.index(isa)
    return frozenset(f for f, need in _ONEDNN_NEEDS.items() if f in flags and rank < _ONEDNN_ISA_ORDER.index(need))


def probe(local_ranks: int = 1, cpuinfo_path: str = "/proc/cpuinfo") -> Machine:
    """Describe this machine: CPU flags (from /proc/cpuinfo), usable cores, CUDA and its bf16, and
    oneDNN's ISA cap when this process sets one (ONEDNN_MAX_CPU_ISA)."""
    import torch

    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            cpuinfo = f.read()
    except OSError:  # no /proc (macOS): no flags known, so no bf16 assumed
        cpuinfo = ""
    cuda = torch.cuda.is_available()
    flags = _cpu_flags(cpuinfo)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    capped = kernel_isa_cap(flags, isa)
    cap = f"ONEDNN_MAX_CPU_ISA={isa.strip()}" if capped else ""
    return Machine(cpu_flags=flags, cpu_count=len(usable_core_ids()), cuda=cuda,
                   cuda_bf16=bool(cuda and torch.cuda.is_bf16_supported()),
                   local_ranks=max(1, int(local_ranks)), cpu_model=_cpu_model(cpuinfo),
                   isa_cap=cap, capped_flags=capped)


def _native_bf16_flags(m: Machine) -> List[str]:
    return [flag for flag in BF16_CPU_FLAGS if flag in m.cpu_flags and flag not in m.capped_flags]


def cpu_has_native_bf16(m: Machine) -> bool:
    return bool(_native_bf16_flags(m))


def _bf16_verdict(m: Machine) -> tuple[bool, str]:
    if m.cuda:
        if m.cuda_bf16:
            return True, "CUDA device computes bf16 natively"
        return False, "CUDA device has no native bf16"
    found = _native_bf16_flags(m)
    if found:
        return True, f"CPU has {'/'.join(found)}, bf16 is native"
    if m.capped_flags:
        return False, (f"CPU has {'/'.join(sorted(m.capped_flags))} but {m.isa_cap} keeps the kernels below it, "
                       "bf16 would be emulated")
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
        from dsrl.errors import ConfigError

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
    cap = f", kernels capped by {m.isa_cap}" if m.isa_cap else ""
    return (f"machine: {model}{m.cpu_count} usable cores, CPU flags [{' '.join(flags) or 'none of interest'}]{cap}, "
            f"{cuda}, {m.local_ranks} local rank(s)")


def cpu_core_range(cores: Sequence[int], local_rank: int, local_world: int) -> str:
    """The cores a rank's vLLM engine binds to (VLLM_CPU_OMP_THREADS_BIND): an even share per local
    rank of the cores this process may use (`cores`, e.g. `usable_core_ids()`), as "lo-hi" when they
    are consecutive, else a comma list. Never a core outside `cores`: binding there would escape a
    cpuset or `taskset`."""
    cores = sorted(int(c) for c in cores) or [0]
    per = max(1, len(cores) // max(local_world, 1))
    start = (local_rank * per) % len(cores)
    share = cores[start:start + per]
    if len(share) == 1:
        return str(share[0])
    if share == list(range(share[0], share[-1] + 1)):
        return f"{share[0]}-{share[-1]}"
    return ",".join(str(c) for c in share)


def parse_core_list(text: str) -> List[int]:
    """Core ids of a list like "1", "2-3" or "0,2-3" (what cpu_core_range and rollout.engine_cores
    write), sorted; pure."""
    ids = set()
    for part in str(text).split(","):
        lo, _, hi = part.strip().partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return sorted(ids)


def local_world_size(default: Optional[int] = None) -> int:
    """Trainer processes on this node, from the launcher's environment."""
    raw = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    if raw:
        try:
            return max(1, int(raw))
        except ValueError as exc:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE/LOCAL_SIZE={raw!r} is not an integer") from exc
    return max(1, default or 1)
