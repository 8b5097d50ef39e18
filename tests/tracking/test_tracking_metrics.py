import json
import math
import time

import pytest

from dsrl.tracking.metrics import MetricsLogger, format_summary


def _read_jsonl(path):
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines]


def _tb_scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc, {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_one_object_per_step_and_nan_is_null(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with MetricsLogger(tmp_path / "run", enabled=True) as log:
        log.log(1, {"reward/mean": 0.25, "timing/step": 1.5})
        with pytest.warns(RuntimeWarning, match="train/kl"):
            log.log(2, {"reward/mean": 0.5, "train/kl": float("nan"), "train/ratio_max": float("inf")})
        log.log(3, {"reward/mean": np.float32(0.75), "train/grad_norm": torch.tensor(2.0),
                    "rollout/n": 8, "train/skipped": False})
        assert [r["step"] for r in log.history] == [1, 2, 3]

    path = tmp_path / "run" / "metrics.jsonl"
    raw = path.read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    rows = _read_jsonl(path)
    assert len(rows) == 3
    assert rows[0] == {"step": 1, "reward/mean": 0.25, "timing/step": 1.5}
    assert rows[1] == {"step": 2, "reward/mean": 0.5, "train/kl": None, "train/ratio_max": None}
    assert rows[2] == {"step": 3, "reward/mean": 0.75, "train/grad_norm": 2.0, "rollout/n": 8.0,
                       "train/skipped": 0.0}
    for row in rows:  # floats only (besides the int step)
        assert isinstance(row["step"], int)
        assert all(v is None or isinstance(v, float) for k, v in row.items() if k != "step")


def test_appends_across_loggers(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, tensorboard=False, enabled=True) as log:
            log.log(step, {"reward/mean": float(step)})
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_tensorboard_scalars_read_back(tmp_path):
    with MetricsLogger(tmp_path, enabled=True) as log:
        for step in range(3):
            log.log(step, {"reward/mean": 0.1 * step, "timing/rollout": 2.0})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file written"
    _, scalars = _tb_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["reward/mean"]] == [0, 1, 2]
    assert [v for _, v in scalars["reward/mean"]] == pytest.approx([0.0, 0.1, 0.2])
    assert scalars["timing/rollout"] == [(0, 2.0), (1, 2.0), (2, 2.0)]


def test_tensorboard_after_a_resume_shows_each_step_once_with_the_resumed_values(tmp_path):
    """A run logs steps 1..5 and dies; its last checkpoint is of step 3. The resumed run redoes
    4 and 5 (other values) and logs 6: TensorBoard reads every step once, 4 and 5 as redone."""
    crashed = MetricsLogger(tmp_path, enabled=True)
    for step in range(1, 6):
        crashed.log(step, {"reward/mean": float(step), "timing/rollout": 1.0})
    kept = crashed.history[:3]
    crashed.close()
    # An event file's name starts with its second: the resumed run's file sorts after the crashed
    # run's (as a later process's does), which is the order TensorBoard reads them in.
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.01)
    resumed = MetricsLogger(tmp_path, enabled=True)
    resumed.restore(kept, step=3, wandb_run_id=None)
    for step in (4, 5, 6):
        resumed.log(step, {"reward/mean": 10.0 * step, "timing/rollout": 2.0})
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    _, scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert scalars["timing/rollout"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]


def test_restore_comes_before_the_first_log(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, enabled=True)
    log.log(1, {"x": 1.0})
    with pytest.raises(RuntimeError, match="restore after the logger started"):
        log.restore([], step=0, wandb_run_id=None)
    log.close()


def test_bad_inputs_rejected(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, enabled=True) as log:
        with pytest.raises(TypeError, match="reward/mean"):
            log.log(1, {"reward/mean": "high"})
        with pytest.raises(TypeError, match="step"):
            log.log(1.0, {"x": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    with pytest.raises(RuntimeError, match="close"):
        log.log(2, {"x": 1.0})


def test_non_main_rank_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = tmp_path / "run"
    log = MetricsLogger(run)  # enabled defaults to is_main_rank() -> False
    assert log.enabled is False
    assert log.log(1, {"reward/mean": 1.0}) is None
    assert log.history == []
    log.close()
    assert not run.exists()
    # the summary line is pure and works everywhere
    assert log.summary_line(1, {"reward/mean": 1.0}).startswith("step 1 | reward 1")


def test_explicit_disable_on_rank0(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    log = MetricsLogger(tmp_path / "run", enabled=False)
    log.log(1, {"reward/mean": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_summary_line():
    # the names the trainer logs; a phase that did not run (0.0 s) is left out
    line = format_summary(12, {
        "reward/mean": 0.4312,
        "timing/step": 3.214,
        "timing/rollout": 1.5,
        "timing/old_logprobs": 0.0,
        "timing/train": 1.25,
        "timing/weight_sync": 0.2,
        "rollout/logprob_diff": 1.2e-5,
        "rollout/response_length": 9.5,
        "train/grad_norm": 0.8731,
        "train/pg_clipfrac": 0.0,
        "train/ppo_kl": None,
        "train/entropy": 2.5,
        "unlisted/metric": 7.0,
    })
    assert line == ("step 12 | reward 0.4312 | resp_len 9.5 | clipfrac 0 | ppo_kl nan | entropy 2.5 "
                    "| grad_norm 0.8731 | lp_diff 1.20e-05 | rollout 1.5s | train 1.25s | sync 0.2s "
                    "| step_time 3.214s")
    assert "\n" not in line
    assert format_summary(0, {}) == "step 0"
    assert math.isnan(float(format_summary(1, {"reward/mean": float("inf")}).split()[-1]))


def test_bucket_metrics_become_a_tensorboard_histogram(tmp_path):
    """async/staleness_hist/J (the fraction of samples J versions stale) is also one histogram."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, enabled=True) as log:
        log.log(3, {"async/staleness_hist/0": 0.25, "async/staleness_hist/1": 0.0, "async/staleness_hist/2": 0.75})
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    assert "async/staleness" in acc.Tags()["histograms"]
    h = acc.Histograms("async/staleness")[0]
    v = h.histogram_value
    assert h.step == 3 and (v.min, v.max, v.num) == (0.0, 2.0, 1.0)
    assert v.sum == 1.5 and v.sum_squares == 3.0  # 0.75 * 2, 0.75 * 4
    assert list(v.bucket_limit) == [0.5, 1.5, 2.5] and list(v.bucket) == [0.25, 0.0, 0.75]
