"""Bad input everywhere, fuzzed with fixed seeds (reproducible; hypothesis is not installed):

- random malformed rows inside otherwise good jsonl / parquet files: each is a DataError naming
  the file and its row (1-based line for jsonl), or is skipped and counted under
  data.on_bad_row=skip; never another exception type;
- random bad config overrides (wrong types, out-of-range numbers, unknown keys, bad names) on top
  of random valid ones, through compose + to_config + validate: each is an error naming the key;
- a few of them through the real CLI: exit code != 0, the key (or file and line) named, no model
  loaded, nothing but logs left in the run folder."""
import dataclasses
import json
import os
import random
import string
import subprocess
import sys
import typing

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dsrl.config import schema
from dsrl.config.schema import register_configs, to_config
from dsrl.data import DataError, make_source
from dsrl.errors import ConfigError
from dsrl.testing import subprocess_env
from dsrl.validation.validate import validate

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
register_configs()


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """datasets' arrow cache goes to the test's folder, not the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


# ================================================================== malformed rows
ROW_KINDS = {"malformed JSON", "not valid UTF-8", "missing field", "wrong type", "empty prompt", "empty answer"}


def _word(r, n=None):
    chars = string.ascii_letters + string.digits + " ,.?!"
    return "".join(r.choice(chars) for _ in range(n or r.randint(1, 30))).strip() or "w"


def _good_record(r):
    text = f"Q{r.randrange(10**9)}: {_word(r)}?"
    if r.random() < 0.5:
        prompt = text
    else:
        system = [{"role": "system", "content": _word(r)}] if r.random() < 0.5 else []
        prompt = system + [{"role": "user", "content": text}]
    answer = r.choice([str(r.randint(-99, 999)), r.randint(0, 10**6), round(r.uniform(-5, 5), 3), _word(r)])
    return {"prompt": prompt, "answer": answer, **({"extra": _word(r)} if r.random() < 0.3 else {})}


def _dumps(obj):
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def _bad_prompt_value(r):
    return r.choice([
        r.randint(-5, 5), r.uniform(-1, 1), r.choice([True, False]), {"text": _word(r)}, [_word(r)], [1, 2],
        "", " " * r.randint(1, 5), "\n\t ", [],
        [{"role": "system", "content": _word(r)}],
        [{"role": "user", "content": "   "}],
        [{"role": _word(r, 6), "content": _word(r)}],
        [{"role": "user", "content": r.choice([None, 3, [], {}])}],
        [{"role": "user"}], [{"content": _word(r)}],
        [{"role": "user", "content": _word(r)}, {"role": "assistant", "content": _word(r)}],
        [{"role": "user", "content": _word(r)}, "not a message"],
    ])


def _bad_answer_value(r):
    return r.choice([[1], {"v": 1}, True, False, "", "   ", float("nan"), float("inf"), -float("inf"), [], {}])


def _bad_line(r):
    """One line (bytes, no newline) that is bad by construction, and the kind it must count as."""
    good = _good_record(r)
    kind = r.randrange(12)
    if kind == 0:  # truncated JSON: any proper prefix of an object is not JSON
        s = _dumps(good)
        return s[:r.randint(1, len(s) - 1)], {"malformed JSON"}
    if kind == 1:  # garbage that cannot start a JSON value
        return (r.choice("#@<>~;|%&") + _word(r)).encode(), {"malformed JSON"}
    if kind == 2:  # bytes that are not UTF-8 inside the prompt
        s = _dumps({**good, "prompt": "abc"})
        i = s.index(b"abc") + r.randint(0, 3)
        byte = bytes([r.choice(list(range(0x80, 0xC2)) + list(range(0xF5, 0x100)))])
        return s[:i] + byte + s[i:], {"not valid UTF-8"}
    if kind == 3:  # a JSON value that is not an object
        return _dumps(r.choice([r.randint(0, 9), _word(r), [good], None, True, [], 1.5])), {"wrong type"}
    if kind == 4:  # a field missing (maybe renamed)
        missing = r.choice(["prompt", "answer"])
        rec = {k: v for k, v in good.items() if k != missing}
        if r.random() < 0.5:
            rec[missing.upper()] = good[missing]
        return _dumps(rec), {"missing field"}
    if kind == 5:  # a field null
        return _dumps({**good, r.choice(["prompt", "answer"]): None}), {"missing field"}
    if kind == 6:  # the prompt of a wrong type or empty
        return _dumps({**good, "prompt": _bad_prompt_value(r)}), {"wrong type", "empty prompt"}
    if kind == 7:  # the answer of a wrong type, empty or not finite
        v = _bad_answer_value(r)
        line = json.dumps({**good, "answer": v}, ensure_ascii=False, allow_nan=True).encode()
        return line, {"wrong type", "empty answer"}
    if kind == 8:  # nesting deeper than the decoder allows
        return (r.choice(["[", '{"a":']) * r.randint(3000, 60000)).encode(), {"malformed JSON"}
    if kind == 9:  # an integer too long to convert
        return b'{"prompt": "x", "answer": ' + b"7" * r.randint(4301, 9000) + b"}", {"malformed JSON"}
    if kind == 10:  # a good line with a character cut out of its structure
        s = _dumps(good).decode()
        cut = r.choice([i for i, ch in enumerate(s) if ch in '{}":,'])
        line = s[:cut] + s[cut + 1:]
        try:  # cutting a quote inside a string can still leave valid JSON: then it is a type or field error
            json.loads(line)
        except ValueError:
            return line.encode(), {"malformed JSON"}
        return _bad_line(r)
    return _dumps(good)[:-1] + b", }", {"malformed JSON"}  # trailing comma


def _case_file(r, path):
    """A jsonl file of good rows around one bad row, blank lines and CRLF at random. Returns the
    bad row's 1-based line number, its possible kinds and the number of good rows."""
    before, after = r.randint(0, 3), r.randint(1 if r.random() < 0.5 else 0, 3)
    bad, kinds = _bad_line(r)
    lines = []
    for _ in range(before):
        lines += [b""] * (r.random() < 0.2) + [_dumps(_good_record(r))]
    lines += [b"  "] * (r.random() < 0.2)
    lines.append(bad)
    line_no = len(lines)
    for _ in range(after):
        lines += [b"\t"] * (r.random() < 0.2) + [_dumps(_good_record(r))]
    eol = r.choice([b"\n", b"\r\n"])
    path.write_bytes(eol.join(lines) + (eol if r.random() < 0.8 else b""))
    return line_no, kinds, before + after


def test_fuzz_malformed_jsonl_rows(tmp_path):
    r = random.Random(20261201)
    for case in range(200):
        f = tmp_path / f"case{case}.jsonl"
        line_no, kinds, n_good = _case_file(r, f)
        with pytest.raises(Exception) as e:
            make_source("jsonl", path=str(f))
        assert type(e.value) is DataError, (case, f.read_bytes()[:200], repr(e.value)[:300])
        assert str(e.value).startswith(f"{f}, line {line_no}: "), (case, str(e.value)[:300])
        if case % 10 == 0:  # skip mode, on a sample of the cases (every kind: the next test)
            if n_good == 0:
                with pytest.raises(DataError, match="no usable training rows"):
                    make_source("jsonl", path=str(f), on_bad_row="skip")
                continue
            src = make_source("jsonl", path=str(f), on_bad_row="skip")
            assert set(src.bad.by_kind()) <= kinds and src.skipped_rows == 1, (case, src.bad.rows)
            assert src.bad.rows[0][0] == f"{f}, line {line_no}"
            assert len(src.train) + len(src.evals) == n_good


def test_fuzz_skip_mode_counts_every_bad_row_of_one_file(tmp_path):
    r = random.Random(7)
    lines, bad = [], {}
    for i in range(600):
        if r.random() < 0.3:
            line, kinds = _bad_line(r)
            lines.append(line)
            bad[i + 1] = kinds
        else:
            lines.append(_dumps(_good_record(r)))
    f = tmp_path / "many.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    src = make_source("jsonl", path=str(f), on_bad_row="skip")
    assert [w for w, _, _ in src.bad.rows] == [f"{f}, line {n}" for n in bad]
    for (_, kind, _), kinds in zip(src.bad.rows, bad.values()):
        assert kind in kinds
    assert {kind for _, kind, _ in src.bad.rows} == ROW_KINDS  # every kind was exercised
    assert len(src.train) + len(src.evals) == 600 - len(bad)


def test_fuzz_malformed_parquet_rows(tmp_path):
    from datasets import Dataset

    r = random.Random(11)
    for case in range(40):
        chat = r.random() < 0.5

        def good():
            text = f"Q{r.randrange(10**9)}?"
            return {"prompt": [{"role": "user", "content": text}] if chat else text, "answer": str(r.randint(0, 99))}

        rows = [good() for _ in range(r.randint(1, 4))]
        if chat:
            bad = r.choice([
                {"prompt": [], "answer": "1"}, {"prompt": None, "answer": "1"},
                {"prompt": [{"role": "robot", "content": "x"}], "answer": "1"},
                {"prompt": [{"role": "user", "content": None}], "answer": "1"},
                {"prompt": [{"role": "system", "content": "x"}], "answer": "1"},
                {"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "answer": "1"},
                {"prompt": [{"role": "user", "content": "x"}], "answer": None},
                {"prompt": [{"role": "user", "content": "x"}], "answer": " "}])
        else:
            bad = r.choice([{"prompt": None, "answer": "1"}, {"prompt": "", "answer": "1"},
                            {"prompt": " \n", "answer": "1"}, {"prompt": "x", "answer": None},
                            {"prompt": "x", "answer": ""}])
        at = r.randint(0, len(rows))
        rows.insert(at, bad)
        f = str(tmp_path / f"case{case}.parquet")
        Dataset.from_list(rows).to_parquet(f)
        with pytest.raises(Exception) as e:
            make_source("parquet", path=f)
        assert type(e.value) is DataError and str(e.value).startswith(f"{f}, row {at + 1}: "), (case, str(e.value))
        src = make_source("parquet", path=f, on_bad_row="skip")
        assert src.skipped_rows == 1 and src.bad.rows[0][0] == f"{f}, row {at + 1}"
        assert set(src.bad.by_kind()) <= ROW_KINDS


# ================================================================== random config overrides
SECTIONS = {k: t for k, t in typing.get_type_hints(schema.Config).items() if dataclasses.is_dataclass(t)}
BAD_BY_TYPE = {  # values no field of that type accepts
    int: ["abc", "1.5", "true", "[1,2]", "{a: 1}", "1e400x"],
    float: ["abc", "true", "[1]", "{a: 1}", "1.2.3"],
    bool: ["maybe", "1.5", "[1]", "abc"],  # not "2": OmegaConf reads any int as a bool (2 -> true)
    list: ["abc", "5", "{a: 1}"],
    dict: ["abc", "5", "[1, 2]"],
}
# Keys whose value must be one of a few names, or name a registered plug-in.
NAMED = ["algo.reuse_logprobs", "algo.kl_loss_type", "algo.loss_agg_mode", "model.dtype", "rollout.dtype",
         "rollout.backend", "logger.wandb_mode", "data.on_bad_row", "algo.advantage_estimator", "algo.policy_loss",
         "algo.tis_function", "data.name", "reward.fn"]
# Out-of-range values, from the ranges the schema comments state.
OUT_OF_RANGE = {
    "actor.zero_stage": [-1, 4, 9], "actor.lr": [0, -1e-5], "actor.eps": [0, -1.0], "actor.weight_decay": [-0.1],
    "actor.grad_clip": [-1.0], "actor.micro_batch_size": [0, -4], "actor.forward_micro_batch_size": [0],
    "actor.num_threads": [-1], "actor.betas": ["[0.9]", "[1.5,0.9]", "[0.9,-0.1]"],
    "rollout.temperature": [0, -1.0], "rollout.top_p": [0, 1.5, -0.2], "rollout.max_new_tokens": [0, -1],
    "rollout.kv_cache_gib": [0, -2], "rollout.gpu_memory_utilization": [0, 1.5], "rollout.max_model_len": [1, 4],
    "rollout.seed": [-1, 2**40],
    "algo.n_samples_per_prompt": [0, -8], "algo.rollout_batch_size": [0, -1], "algo.global_batch_size": [0, -64],
    "algo.num_steps_per_rollout": [0, -2], "algo.eps_clip": [0, -0.2], "algo.eps_clip_c": [1.0, 0.5],
    "algo.tis_clip": [0, -2.0], "algo.kl_coef": [-0.1], "algo.gamma": [1.5, -0.5],
    "model.attention_dropout": [1.0, -0.1], "model.hidden_dropout": [1.5, -1.0],
    "data.num_operands": [1, 0], "data.digits": [0, -3], "data.num_eval": [-1], "data.eval_fraction": [0, 1.0, 2.5],
    "data.max_prompt_tokens": [0, -5, 10**6], "data.seed": [-7, 2**33],
    "trainer.total_steps": [0, -1], "trainer.seed": [-1, 2**50], "reward.timeout_s": [0, -3.0],
    "logger.plot_every": [0, -1], "rollout.max_restarts": [-1], "rollout.timeout_s": [0, -5.0],
    "trainer.max_skipped_steps": [0, -1], "trainer.save_every": [-1], "trainer.keep_checkpoints": [-2],
}
# Valid overrides mixed in around the bad one (checked to validate together).
NOISE = ["actor.lr=3e-5", "rollout.max_new_tokens=8", "data.seed=7", "trainer.total_steps=3", "actor.zero_stage=3",
         "rollout.temperature=0.7", "logger.progress=false", "data.digits=2", "trainer.eval_before=false",
         "actor.micro_batch_size=4", "data.system_prompt=hi", "reward.timeout_s=2.5", "data.on_bad_row=skip",
         "algo.reuse_logprobs=auto", "logger.plot_every=5", "rollout.max_model_len=256"]
BASES = [[], ["+exp=grpo_reuse"]]


def _fields():
    """(dotted key, python type) of every config field, Optional[...] unwrapped."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            args = [a for a in typing.get_args(t) if a is not type(None)]
            t = args[0] if typing.get_origin(t) is typing.Union else t
            out.append((f"{section}.{f.name}", typing.get_origin(t) or t))
    return out


FIELDS = _fields()


def _compose(overrides):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


_BASE_CFGS = {}


def _with_overrides(base, overrides):
    """The composed `base` config with `overrides` applied by Hydra's own override code (the
    step of compose that follows the defaults tree; composing from scratch per case takes
    ~0.3 s). Only key overrides: the fuzz never changes a config group."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if tuple(base) not in _BASE_CFGS:
        _BASE_CFGS[tuple(base)] = _compose(base)
    cfg = copy.deepcopy(_BASE_CFGS[tuple(base)])
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(list(overrides)), cfg)
    return cfg


def _bad_override(r):
    """(override, the text the error must contain, category)."""
    category = r.choice(["type", "unknown", "name", "range", "nonfinite"])
    if category == "type":
        key, t = r.choice([(k, t) for k, t in FIELDS if t in BAD_BY_TYPE])
        return f"{key}={r.choice(BAD_BY_TYPE[t])}", key, category
    if category == "unknown":
        section = r.choice(list(SECTIONS) + ["zz_group"])
        name = "zz_" + "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(3, 9)))
        needle = "zz_group" if section == "zz_group" else name  # an unknown group is named itself
        return f"{r.choice(['', '+', '++'])}{section}.{name}={r.randint(0, 9)}", needle, category
    if category == "name":
        key = r.choice(NAMED)
        value = r.choice(["zz" + "".join(r.choice(string.ascii_lowercase) for _ in range(6)),
                          "zz_no_module.fn", "zz_no_module:fn", "os.path.zz_no_attr"])
        return f"{key}={value}", key, category
    if category == "range":
        key = r.choice(sorted(OUT_OF_RANGE))
        return f"{key}={r.choice(OUT_OF_RANGE[key])}", key, category
    key = r.choice([k for k, t in FIELDS if t is float])
    return f"{key}={r.choice(['nan', 'inf', '-inf'])}", key, category


ERRORS = (ConfigError, HydraException, OmegaConfBaseException)


def _config_error(base, overrides):
    """The one error a bad config must raise (override parsing, typed schema, or validation)."""
    try:
        validate(to_config(_with_overrides(base, overrides)))
    except ERRORS as e:
        return e
    return None


def _message(e):
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def test_noise_overrides_are_valid_together():
    for base in BASES:
        validate(to_config(_compose(base + NOISE)))
        validate(to_config(_with_overrides(base, NOISE)))  # the fuzz's shortcut agrees with compose


def test_fuzz_bad_config_overrides_name_the_key():
    r = random.Random(4242)
    categories = set()
    for case in range(200):
        override, key, category = _bad_override(r)
        noise = [n for n in r.sample(NOISE, r.randint(0, 3)) if n.split("=")[0] != override.split("=")[0].lstrip("+")]
        base, overrides = r.choice(BASES), noise + [override]
        try:
            e = _config_error(base, overrides)
        except Exception as other:  # noqa: BLE001 - any other type is a finding
            pytest.fail(f"case {case} {base + overrides}: {type(other).__name__}: {other}")
        assert e is not None, f"case {case}: {overrides} was accepted"
        assert key in _message(e), (case, overrides, _message(e))
        categories.add(category)
    assert categories == {"type", "unknown", "name", "range", "nonfinite"}


# ================================================================== through the real CLI
def _run_cli(tmp_path, name, overrides):
    run_dir = tmp_path / name
    env = subprocess_env(HYDRA_FULL_ERROR="0", HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    r = subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", *overrides, f"hydra.run.dir={run_dir}"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    return r, r.stdout + r.stderr, run_dir


@pytest.mark.slow
def test_fuzz_cases_through_the_cli_fail_fast_and_leave_nothing(tmp_path):
    r = random.Random(99)
    cases = []
    for category in ("type", "unknown", "name", "range"):  # one seeded case of each category
        while True:
            override, key, cat = _bad_override(r)
            if cat == category:
                cases.append(([override], [key]))
                break
    f = tmp_path / "bad.jsonl"
    line_no, _, _ = _case_file(r, f)
    cases.append((["data=jsonl", f"data.path={f}", "reward.fn=gsm8k"], [f"{f}, line {line_no}"]))
    for i, (overrides, needles) in enumerate(cases):
        proc, out, run_dir = _run_cli(tmp_path, f"run{i}", overrides)
        assert proc.returncode != 0, (overrides, out[-2000:])
        for needle in needles:
            assert needle in out, (overrides, out[-2000:])
        assert "Traceback" not in out or "HYDRA_FULL_ERROR" in out, (overrides, out[-2000:])
        assert "Loading weights" not in out and "deepspeed" not in out.lower(), (overrides, out[-2000:])
        # Hydra's own record and the console's log files may be there; no output of a run.
        leftovers = sorted(p for p in (os.listdir(run_dir) if run_dir.exists() else [])
                           if p not in (".hydra", ".vllm_logging.json") and not p.endswith(".log"))
        assert leftovers == [], (overrides, leftovers)
