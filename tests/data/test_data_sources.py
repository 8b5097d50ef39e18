"""Prompt sources: held-out split, determinism, GSM8K loading."""
import random

import pytest

from dsrl.config.schema import DataConfig
from dsrl.data import (ArithSource, Prompt, PromptStream, build_source, make_source,
                       parse_gsm8k_answer, source_names)
from dsrl.reward import get_verifier


def _ids(prompts):
    return {p.uid for p in prompts}


def test_registry():
    assert {"arith", "gsm8k"} <= set(source_names())
    with pytest.raises(KeyError, match="data.name"):
        make_source("nope")
    src = build_source(DataConfig(name="arith", digits=2, num_operands=3))
    assert isinstance(src, ArithSource) and (src.digits, src.num_operands) == (2, 3)
    assert build_source({"name": "arith"}).default_verifier == "arith"


def test_arith_prompt_shape():
    src = make_source("arith", digits=1)
    p = src.sample_train(1, random.Random(3))[0]
    assert isinstance(p, Prompt)
    assert p.messages[0]["role"] == "user"
    a, b = p.meta["operands"]
    assert p.messages[0]["content"] == f"Compute {a} + {b}. Respond with the result only."
    assert p.answer == str(a + b) and 0 <= a <= 9 and 0 <= b <= 9
    assert get_verifier(src.default_verifier)(p.answer, p) == 1.0


@pytest.mark.parametrize("digits,num_operands", [(1, 2), (1, 3), (2, 2), (3, 2), (5, 2)])
def test_arith_eval_disjoint_and_deterministic(digits, num_operands):
    src = make_source("arith", digits=digits, num_operands=num_operands)
    ev = src.eval_set(60)
    assert len(ev) == 60
    assert len(_ids(ev)) == len(ev)  # no repeats
    # Deterministic: same list from a fresh instance, independent of any training seed.
    assert [p.uid for p in make_source("arith", digits=digits,
                                        num_operands=num_operands).eval_set(60)] == [p.uid for p in ev]
    # The eval set is a prefix-stable list.
    assert [p.uid for p in src.eval_set(10)] == [p.uid for p in ev[:10]]
    # Disjoint from the training stream, also up to operand order (3+5 vs 5+3).
    held = {tuple(sorted(p.meta["operands"])) for p in ev if p.meta["split"] == "eval"}
    train = src.sample_train(3000, random.Random(0))
    assert all(tuple(sorted(p.meta["operands"])) not in held for p in train)
    # Past a small held-out pool, eval prompts are training problems in an unseen phrasing:
    # no eval prompt string ever appears in the training stream.
    assert not {p.text for p in ev} & {p.text for p in train}
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    for p in train[:200] + ev:
        ops = p.meta["operands"]
        assert len(ops) == num_operands and all(lo <= x < 10 ** digits for x in ops)
        assert p.answer == str(sum(ops))


def test_arith_one_digit_space_split():
    src = make_source("arith", digits=1)
    # 100 ordered pairs: every pair is on exactly one side.
    train_pairs = {p.uid for p in src.sample_train(5000, random.Random(1))}
    eval_pairs = _ids([p for p in src.eval_set(1000) if p.meta["split"] == "eval"])
    assert len(train_pairs) + len(eval_pairs) == 100
    assert 20 <= len(eval_pairs) <= 40
    # A short eval set covers distinct problems first.
    first = [tuple(sorted(p.meta["operands"])) for p in src.eval_set(10)]
    assert len(set(first)) == 10
    # 100 eval prompts: the 28 held-out-problem prompts first, then unseen phrasings.
    ev = src.eval_set(100)
    assert len(ev) == 100 and [p.meta["split"] for p in ev[:len(eval_pairs)]] == ["eval"] * len(eval_pairs)
    assert all(p.meta["split"] == "eval-rephrased" for p in ev[len(eval_pairs):])
    assert not {p.text for p in ev} & {p.text for p in src.sample_train(5000, random.Random(1))}


def test_train_stream_seeded_and_resumable():
    src = make_source("arith", digits=2)
    a = PromptStream(src, seed=7)
    b = PromptStream(src, seed=7)
    assert [p.uid for p in a.next(16)] == [p.uid for p in b.next(16)]
    state = a.state_dict()
    nxt = [p.uid for p in a.next(8)]
    c = PromptStream(src, seed=0)
    c.load_state_dict(state)
    assert [p.uid for p in c.next(8)] == nxt and c.num_drawn == 24
    assert [p.uid for p in PromptStream(src, seed=8).next(16)] != [p.uid for p in b.next(16)]
    # int seeds and numpy generators are accepted as rng.
    np = pytest.importorskip("numpy")
    assert len(src.sample_train(4, np.random.default_rng(0))) == 4
    assert [p.uid for p in src.sample_train(4, 5)] == [p.uid for p in src.sample_train(4, 5)]


def test_arith_bad_knobs():
    with pytest.raises(ValueError, match="digits"):
        make_source("arith", digits=0)
    with pytest.raises(ValueError, match="num_operands"):
        make_source("arith", num_operands=1)


def test_gsm8k_loads_real_splits():
    src = make_source("gsm8k")
    assert len(src.train_rows) == 7473 and len(src.test_rows) == 1319
    # First training problem of the official file (Natalia's clips): answer 72.
    q, ans, sol, idx = src.train_rows[0]
    assert q.startswith("Natalia sold clips") and ans == "72" and idx == 0
    assert src.test_rows[0][1] == "18"  # Janet's ducks
    # Every answer parsed to a plain number (commas removed).
    for _, a, _, _ in src.train_rows + src.test_rows:
        float(a)
        assert "," not in a
    ev = src.eval_set(50)
    assert len(ev) == 50 and all(p.meta["split"] == "test" for p in ev)
    assert [p.uid for p in ev] == [p.uid for p in make_source("gsm8k").eval_set(50)]
    train = src.sample_train(200, random.Random(0))
    assert all(p.meta["split"] == "train" for p in train)
    assert not (_ids(train) & _ids(src.eval_set(1319)))
    assert len(_ids(train)) == 200  # no repeats within one draw
    p = train[0]
    assert p.meta["question"] in p.messages[0]["content"]
    assert src.default_verifier == "gsm8k"
    assert get_verifier("gsm8k")(f"... so the answer is {p.answer}.", p) == 1.0


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("a\nb <<1+1=2>>2\n#### 1,080") == "1080"
    assert parse_gsm8k_answer("#### -5") == "-5"
    with pytest.raises(ValueError):
        parse_gsm8k_answer("no marker")


def test_prompt_roundtrip():
    p = make_source("arith").eval_set(1)[0]
    q = Prompt.from_dict(p.to_dict())
    assert q == p and q.meta == p.meta
    with pytest.raises(ValueError):
        Prompt(messages=[{"content": "x"}], answer="1")
