import random

from dsrl.tracking.plots import plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _history(n=20):
    rng = random.Random(0)
    rows = []
    for step in range(1, n + 1):
        row = {
            "step": step,
            "reward/mean": min(1.0, 0.05 * step + rng.random() * 0.1),
            "timing/rollout": 2.0 + rng.random(),
            "timing/old_logprobs": 0.0,  # skipped by log-prob reuse
            "timing/ref_logprobs": 0.4,
            "timing/train": 1.5,
            "timing/weight_sync": 0.2,
        }
        row["timing/step"] = sum(v for k, v in row.items() if k.startswith("timing/")) + 0.1
        if step % 5 == 0:
            row["eval/accuracy"] = 0.04 * step
        rows.append(row)
    return rows


def _check_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes, len(data)


def test_full_history_plot(tmp_path):
    out = plot_run(_history(), tmp_path / "plots" / "run.png")
    assert out == tmp_path / "plots" / "run.png"
    _check_png(out)


def test_missing_keys_and_nulls(tmp_path):
    rows = [
        {"step": 3, "reward/mean": 0.2, "timing/train": 1.0},
        {"step": 1, "reward/mean": None, "timing/rollout": 2.0, "timing/step": 2.5},
        {"reward/mean": 0.3},  # no step key -> placed at its index
        {"step": 4, "eval/accuracy": 0.5, "train/kl": float("nan")},
    ]
    _check_png(plot_run(rows, tmp_path / "a.png"), min_bytes=5_000)
    _check_png(plot_run([{"step": 1, "timing/train": 1.0, "reward/mean": 0.1}], tmp_path / "b.png"),
               min_bytes=5_000)


def test_empty_history(tmp_path):
    _check_png(plot_run([], tmp_path / "empty.png"), min_bytes=5_000)
