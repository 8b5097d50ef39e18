"""DAPO dynamic sampling (algo.dynamic_sampling): the collector of dsrl.rollout.dynamic on
scripted rounds, then the real Trainer loop around a scripted worker/verifier
(tests/trainer/_loop_fakes.py): all-equal groups dropped, rounds bounded, counts logged, request
seeds unique per (step, round, prompt) and reproducible, and nothing changed when it is off."""
from __future__ import annotations

import pytest

from _loop_fakes import make_cfg, make_trainer
from dsrl.actor.batch import Sample
from dsrl.errors import ConfigError
from dsrl.rollout.dynamic import collect_rollout, next_round_size
from dsrl.rollout.seeds import request_seeds

N = 4  # samples per group


def scripted_rounds(script):
    """generate_round for collect_rollout: round r returns the groups of script[r] ("I":
    rewards 0,1,0,1; "U": all 0), numbered as one generation; records each call."""
    calls = []

    def generate_round(sampling_round, count):
        kinds = script[sampling_round]
        calls.append((sampling_round, count))
        if count != len(kinds):
            raise AssertionError(f"round {sampling_round}: asked for {count} prompts, script has {len(kinds)}")
        out = []
        for g, kind in enumerate(kinds):
            for j in range(N):
                out.append(Sample(prompt_ids=[1], response_ids=[2] * (1 + j), rollout_log_probs=[-1.0] * (1 + j),
                                  group=g, index=len(out), reward=float(j % 2) if kind == "I" else 0.0,
                                  text=f"{sampling_round}:{g}:{kind}"))
        return out
    return generate_round, calls


def groups_of(samples):
    return [s.text for s in samples[::N]]


def test_round_size_follows_the_informative_rate():
    assert next_round_size(need=2, informative=0, drawn=4, share=4) == 4  # nothing informative yet: a full share
    assert next_round_size(need=2, informative=2, drawn=4, share=4) == 4  # rate 1/2: 2 / (1/2)
    assert next_round_size(need=1, informative=3, drawn=8, share=4) == 3  # ceil(1 * 8 / 3)
    assert next_round_size(need=1, informative=4, drawn=4, share=4) == 1
    assert next_round_size(need=3, informative=1, drawn=8, share=4) == 4  # capped at the share


def test_all_equal_groups_are_dropped_until_the_share_is_informative():
    gen, calls = scripted_rounds(["IUUI", "UIUU", "IIU"])
    out = collect_rollout(gen, share=4, dynamic=True, max_rounds=5)
    # rate after round 0: 2/4 -> 2 more need 4 prompts; after round 1: 3/8 -> 1 more needs 3.
    assert calls == [(0, 4), (1, 4), (2, 3)]
    assert out.rounds == 3
    assert groups_of(out.samples) == ["0:0:I", "0:3:I", "1:1:I", "2:0:I"]
    assert (out.kept_groups, out.dropped_groups, out.filler_groups, out.surplus_groups) == (4, 6, 0, 1)
    assert [s.group for s in out.samples] == [g for g in range(4) for _ in range(N)]
    assert [s.index for s in out.samples] == list(range(4 * N))
    assert out.generated == 11 * N
    assert out.reward_sum == 5 * 2.0  # five "I" groups generated, each 0+1+0+1
    assert out.length_sum == 11 * (1 + 2 + 3 + 4)


def test_rounds_are_bounded_and_the_shortfall_is_filled_with_the_latest_all_equal_groups():
    gen, calls = scripted_rounds(["UIU", "UUU"])
    out = collect_rollout(gen, share=3, dynamic=True, max_rounds=2)
    assert calls == [(0, 3), (1, 3)]  # rate 1/3: 2 more would need 6, capped at the share
    assert out.rounds == 2
    assert groups_of(out.samples) == ["0:1:I", "1:1:U", "1:2:U"]  # every rank trains exactly its share
    assert (out.kept_groups, out.dropped_groups, out.filler_groups, out.surplus_groups) == (1, 3, 2, 0)
    assert [s.group for s in out.samples] == [g for g in range(3) for _ in range(N)]


def test_one_round_when_the_first_generation_is_all_informative():
    gen, calls = scripted_rounds(["II"])
    out = collect_rollout(gen, share=2, dynamic=True, max_rounds=4)
    assert calls == [(0, 2)] and out.rounds == 1 and out.dropped_groups == 0


def test_without_dynamic_sampling_it_is_one_generation_of_the_same_samples():
    gen, calls = scripted_rounds(["UIU"])
    expected = gen(0, 3)
    calls.clear()
    gen_again, _ = scripted_rounds(["UIU"])
    captured = []

    def generate_round(r, count):
        captured.extend(gen_again(r, count))
        return captured

    out = collect_rollout(generate_round, share=3, dynamic=False, max_rounds=4)
    assert all(a is b for a, b in zip(out.samples, captured, strict=True))  # the very objects, all groups kept
    assert [(s.group, s.index, s.reward) for s in out.samples] == [(s.group, s.index, s.reward) for s in expected]
    assert (out.rounds, out.kept_groups, out.dropped_groups) == (1, 3, 0)


def test_max_sampling_rounds_is_validated():
    with pytest.raises(ConfigError, match=r"algo.max_sampling_rounds=0 must be >= 1"):
        make_cfg(dynamic_sampling=True, max_sampling_rounds=0)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        collect_rollout(lambda r, c: [], share=1, dynamic=True, max_rounds=0)


# ---------------------------------------------------------------------------------------- in the loop
def _run(tmp_path, name, **algo):
    events = []
    cfg = make_cfg(groups=2, group_size=N, total_steps=2, **algo)
    trainer = make_trainer(cfg, tmp_path / name, events, kinds="UI")
    trainer.fit()
    return trainer, events, cfg


def test_the_loop_trains_only_informative_groups_and_logs_the_counts(tmp_path):
    trainer, events, cfg = _run(tmp_path, "dyn", dynamic_sampling=True, max_sampling_rounds=3)
    generates = [e for e in events if e[0] == "generate"]
    # Each step: round 0 draws U, I (rate 1/2) -> round 1 draws 2 more: U, I.
    assert [len(e[2]) for e in generates] == [2, 2, 2, 2]
    for samples in trainer.trained:
        assert len(samples) == 2 * N
        assert all(s.extra == {} and s.group == i // N and s.index == i for i, s in enumerate(samples))
        assert sorted({float(s.reward) for s in samples}) == [0.0, 1.0]
    trained_prompts = [[s.prompt_ids for s in samples[::N]] for samples in trainer.trained]
    assert [[chr(ids[0]) for ids in step] for step in trained_prompts] == [["I", "I"], ["I", "I"]]
    for row in trainer.logger.history:
        assert row["rollout/sampling_rounds"] == 2.0
        assert (row["rollout/kept_groups"], row["rollout/dropped_groups"], row["rollout/filler_groups"]) == (2, 2, 0)
        assert row["reward/mean"] == 4.0 / 16  # every generated sample, the dropped groups included
    # Seeds: round 0 exactly as without dynamic sampling, round 1 fresh; all distinct.
    seed = cfg.rollout.seed
    assert [e[3] for e in generates] == [request_seeds(seed, 1, 0, 2), request_seeds(seed, 1, 0, 2, 1),
                                         request_seeds(seed, 2, 0, 2), request_seeds(seed, 2, 0, 2, 1)]
    every = [s + k for e in generates for s in e[3] for k in range(N)]  # vLLM: sample k of a request uses s + k
    assert len(set(every)) == len(every)


def test_dynamic_sampling_is_reproducible(tmp_path):
    _, first, _ = _run(tmp_path, "a", dynamic_sampling=True)
    _, second, _ = _run(tmp_path, "b", dynamic_sampling=True)
    assert [e for e in first if e[0] == "generate"] == [e for e in second if e[0] == "generate"]


def test_off_changes_nothing(tmp_path):
    trainer, events, cfg = _run(tmp_path, "off")
    generates = [e for e in events if e[0] == "generate"]
    assert [e[3] for e in generates] == [request_seeds(cfg.rollout.seed, k, 0, 2) for k in (1, 2)]
    assert [[chr(s.prompt_ids[0]) for s in samples[::N]] for samples in trainer.trained] == [["U", "I"], ["U", "I"]]
    assert not any(k.startswith("rollout/sampling") or k.endswith("_groups") for k in trainer.logger.history[0])
