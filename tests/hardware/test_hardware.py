"""dsrl.hardware: the decision table over made-up machines, explicit values left alone, the real
probe against /proc/cpuinfo, and the resolved values reaching config.yaml."""
import logging
import os
import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dsrl import hardware
from dsrl.config.schema import Config, register_configs, to_config
from dsrl.errors import ConfigError
from dsrl.hardware import Machine
from dsrl.validation.validate import validate

CONF = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))
register_configs()

AVX2_EPYC = Machine(cpu_flags=frozenset({"sse4_2", "avx", "avx2", "fma"}), cpu_count=2)
AVX512_BF16 = Machine(cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}), cpu_count=2)
SAPPHIRE_RAPIDS = Machine(cpu_flags=frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}), cpu_count=8)
AVX512_NO_BF16 = Machine(cpu_flags=frozenset({"avx2", "avx512f", "avx512bw"}), cpu_count=4)
H200 = Machine(cpu_flags=frozenset({"avx2"}), cpu_count=16, cuda=True, cuda_bf16=True)
V100 = Machine(cpu_flags=frozenset({"avx2", "avx512_bf16"}), cpu_count=16, cuda=True, cuda_bf16=False)

KEYS = ("model.dtype", "rollout.dtype", "model.attn_implementation", "rollout.enforce_eager", "actor.num_threads")


def _table(cfg, machine):
    return {d.key: d.value for d in hardware.decide(cfg, machine)}


@pytest.mark.parametrize("machine,expected", [
    (AVX2_EPYC, ("float32", "float32", "eager", True, 2)),
    (AVX512_NO_BF16, ("float32", "float32", "eager", True, 4)),
    (AVX512_BF16, ("bfloat16", "bfloat16", "eager", True, 2)),
    (SAPPHIRE_RAPIDS, ("bfloat16", "bfloat16", "eager", True, 8)),
    (H200, ("bfloat16", "bfloat16", "sdpa", False, 16)),
    # CUDA decides for a CUDA run, whatever the host CPU has.
    (V100, ("float32", "float32", "sdpa", False, 16)),
], ids=["avx2", "avx512-no-bf16", "avx512_bf16", "amx", "cuda-bf16", "cuda-no-bf16"])
def test_auto_decision_table(machine, expected):
    cfg = Config()  # schema defaults: every machine-dependent key is auto
    decisions = hardware.decide(cfg, machine)
    assert [d.key for d in decisions] == list(KEYS)
    assert tuple(d.value for d in decisions) == expected
    for d in decisions:
        assert d.auto and d.reason.strip() and not d.warning
        assert "\n" not in d.line() and d.line().startswith(f"{d.key}={d.value} (auto: ")
    # decide() reads only: the config still says auto
    assert (cfg.model.dtype, cfg.rollout.dtype, cfg.model.attn_implementation) == ("auto", "auto", "auto")
    assert cfg.rollout.enforce_eager is None and cfg.actor.num_threads == 0


def test_reasons_name_the_cause():
    by_key = {d.key: d for d in hardware.decide(Config(), AVX2_EPYC)}
    assert by_key["model.dtype"].line() == \
        "model.dtype=float32 (auto: CPU has no AMX/AVX512-BF16, bf16 would be emulated)"
    assert "amx_bf16" in hardware.decide(Config(), SAPPHIRE_RAPIDS)[0].reason
    assert "avx512_bf16" in hardware.decide(Config(), AVX512_BF16)[0].reason
    assert "CUDA" in hardware.decide(Config(), V100)[0].reason


@pytest.mark.parametrize("machine", [AVX2_EPYC, SAPPHIRE_RAPIDS, H200, V100], ids=["avx2", "amx", "cuda", "cuda-no-bf16"])
def test_explicit_values_are_never_overridden(machine):
    cfg = Config()
    cfg.model.dtype, cfg.rollout.dtype = "float32", "bfloat16"
    cfg.model.attn_implementation = "flash_attention_2"
    cfg.rollout.enforce_eager = False
    cfg.actor.num_threads = 3
    decisions = hardware.decide(cfg, machine)
    assert tuple(d.value for d in decisions) == ("float32", "bfloat16", "flash_attention_2", False, 3)
    assert not any(d.auto for d in decisions)
    assert all(d.reason == "set in config" for d in decisions)
    cfg.rollout.enforce_eager = True
    assert _table(cfg, machine)["rollout.enforce_eager"] is True


def test_explicit_bf16_where_it_is_emulated_warns_but_stays():
    cfg = Config()
    cfg.model.dtype = "bfloat16"
    d = hardware.decide(cfg, AVX2_EPYC)[0]
    assert d.value == "bfloat16" and not d.auto
    assert "emulated" in d.warning and "emulated" in d.line()
    assert not hardware.decide(cfg, SAPPHIRE_RAPIDS)[0].warning  # native there: no warning


@pytest.mark.parametrize("cores,ranks,threads", [(2, 1, 2), (16, 4, 4), (16, 3, 5), (2, 4, 1)])
def test_threads_split_cores_between_local_ranks(cores, ranks, threads):
    m = Machine(cpu_count=cores, local_ranks=ranks)
    assert _table(Config(), m)["actor.num_threads"] == threads


def test_negative_threads_is_a_config_error():
    cfg = Config()
    cfg.actor.num_threads = -1
    with pytest.raises(ConfigError, match=r"actor\.num_threads=-1"):
        hardware.decide(cfg, AVX2_EPYC)


def test_validate_accepts_auto_and_names_a_bad_dtype():
    validate(Config())
    cfg = Config()
    cfg.rollout.dtype = "float16"
    with pytest.raises(ConfigError, match=r"rollout\.dtype='float16'"):
        validate(cfg)


def test_probe_parses_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the suite may run under a cap (docs/concepts/exactness.md)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Made-up CPU 9000\n"
                    "flags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    m = hardware.probe(local_ranks=2, cpuinfo_path=str(info))
    assert m.cpu_flags == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}
    assert m.cpu_model == "Made-up CPU 9000" and m.local_ranks == 2
    assert hardware.cpu_has_native_bf16(m)
    missing = hardware.probe(cpuinfo_path=str(tmp_path / "absent"))
    assert missing.cpu_flags == frozenset() and not hardware.cpu_has_native_bf16(missing)


def test_probe_of_this_machine_matches_proc_cpuinfo():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    with open("/proc/cpuinfo") as f:
        text = f.read()
    native = bool(re.search(r"^flags\s*:.*\b(amx_bf16|avx512_bf16)\b", text, re.M))
    # A oneDNN cap below AVX512_CORE_BF16 (docs/concepts/exactness.md: the suite on another kernel path)
    # takes every bf16 instruction away.
    below_bf16 = {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni"}
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower() in below_bf16:
        native = False
    m = hardware.probe()
    assert hardware.cpu_has_native_bf16(m) == native
    assert m.cpu_count == len(os.sched_getaffinity(0))
    if not m.cuda:
        assert _table(Config(), m)["model.dtype"] == ("bfloat16" if native else "float32")


def test_cpu_core_range():
    assert hardware.cpu_core_range([0, 1], 0, 1) == "0-1"
    assert hardware.cpu_core_range(range(16), 1, 4) == "4-7"
    assert hardware.cpu_core_range([0, 1], 1, 2) == "1"
    # Only the cores this process may use (`taskset -c 1`, a cpuset): never one outside them.
    assert hardware.cpu_core_range([1], 0, 1) == "1"
    assert hardware.cpu_core_range([3, 1], 0, 2) == "1" and hardware.cpu_core_range([3, 1], 1, 2) == "3"
    assert hardware.cpu_core_range([0, 2, 4, 5], 0, 1) == "0,2,4,5"
    assert hardware.cpu_core_range([4, 5, 6, 7], 1, 2) == "6-7"


def test_usable_core_ids_is_the_affinity():
    assert hardware.usable_core_ids() == sorted(os.sched_getaffinity(0))


AMX_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})


@pytest.mark.parametrize("isa,hidden", [
    ("", set()), ("DEFAULT", set()), ("not_an_isa", set()),
    ("AVX2", {"amx_bf16", "avx512_bf16"}), ("avx512_core_vnni", {"amx_bf16", "avx512_bf16"}),
    ("AVX512_CORE_BF16", {"amx_bf16"}), ("AVX512_CORE_FP16", {"amx_bf16"}),
    ("AVX512_CORE_AMX", set()), ("avx10_1_512_amx", set()),
])
def test_onednn_isa_cap_hides_the_bf16_flags_above_it(isa, hidden):
    assert hardware.kernel_isa_cap(AMX_FLAGS, isa) == hidden
    assert hardware.kernel_isa_cap(frozenset({"avx2"}), isa) == frozenset()  # nothing to hide


def test_capped_amx_machine_decides_float32_and_says_why(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    m = hardware.probe(cpuinfo_path=str(info))
    assert m.capped_flags == {"amx_bf16", "avx512_bf16"} and m.isa_cap == "ONEDNN_MAX_CPU_ISA=AVX2"
    assert not hardware.cpu_has_native_bf16(m)
    d = hardware.decide(Config(), m)[0]
    assert (d.key, d.value) == ("model.dtype", "float32")
    assert d.reason == "CPU has amx_bf16/avx512_bf16 but ONEDNN_MAX_CPU_ISA=AVX2 keeps the kernels below it, " \
                       "bf16 would be emulated"
    assert "kernels capped by ONEDNN_MAX_CPU_ISA=AVX2" in hardware.describe(m)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX off, AVX512-BF16 still native
    m = hardware.probe(cpuinfo_path=str(info))
    assert hardware.decide(Config(), m)[0].value == "bfloat16"
    assert "avx512_bf16" in hardware.decide(Config(), m)[0].reason
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert hardware.probe(cpuinfo_path=str(info)).capped_flags == frozenset()


def test_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert hardware.local_world_size(3) == 3
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert hardware.local_world_size(8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        hardware.local_world_size()


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_config_yaml_records_resolved_values(tmp_path):
    node = _compose("+exp=grpo_reuse", "actor.num_threads=5")
    cfg = to_config(node)
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("auto", "auto")  # the preset no longer forces bf16
    decisions = hardware.decide(cfg, AVX2_EPYC)
    hardware.apply(cfg, decisions)
    hardware.record_resolved(node, decisions)
    path = tmp_path / "config.yaml"
    OmegaConf.save(node, path, resolve=True)  # what dsrl.main writes
    saved = yaml.safe_load(path.read_text())
    assert saved["model"]["dtype"] == "float32" and saved["rollout"]["dtype"] == "float32"
    assert saved["model"]["attn_implementation"] == "eager"
    assert saved["rollout"]["enforce_eager"] is True
    assert saved["actor"]["num_threads"] == 5  # explicit: kept
    # the saved file is itself a valid config that resolves to the same run
    again = to_config(OmegaConf.load(path))
    assert (again.model, again.rollout, again.actor) == (cfg.model, cfg.rollout, cfg.actor)


@pytest.fixture
def env_ranks(monkeypatch):
    """Ranks from the environment only (another test module may hold an in-process group)."""
    from dsrl.distributed import ranks

    monkeypatch.setattr(ranks, "_dist_initialized", lambda: False)


def test_main_resolves_logs_once_and_updates_node(monkeypatch, caplog, env_ranks):
    import dsrl.main as main

    monkeypatch.setattr(hardware, "probe", lambda local_ranks=1: AVX2_EPYC)
    monkeypatch.delenv("RANK", raising=False)
    node = _compose()
    cfg = to_config(node)
    with caplog.at_level(logging.INFO, logger="dsrl"):
        main._resolve_hardware(cfg, node)
    assert cfg.model.dtype == "float32" and node.model.dtype == "float32"
    assert node.rollout.enforce_eager is True and node.actor.num_threads == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "dsrl"]
    assert "model.dtype=float32 (auto: CPU has no AMX/AVX512-BF16, bf16 would be emulated)" in lines
    assert sum(line.startswith("machine:") for line in lines) == 1 and len(lines) == 1 + len(KEYS)


def test_other_ranks_do_not_log(monkeypatch, caplog, env_ranks):
    import dsrl.main as main

    monkeypatch.setattr(hardware, "probe", lambda local_ranks=1: AVX2_EPYC)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    node = _compose()
    cfg = to_config(node)
    with caplog.at_level(logging.INFO, logger="dsrl"):
        main._resolve_hardware(cfg, node)
    assert cfg.model.dtype == "float32"
    assert not [r for r in caplog.records if r.name == "dsrl"]
