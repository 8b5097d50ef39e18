"""W&B through its library: an offline run really holds the logged values and the config; `auto`
goes offline without a key (no network call) or without a reachable host."""
import json
import math
import socket
import struct
import threading
from pathlib import Path

import pytest

from dsrl.tracking import wandb_sink
from dsrl.tracking.metrics import MetricsLogger
from dsrl.tracking.wandb_sink import resolve_wandb_mode, wandb_api_key_configured, wandb_host_reachable

pytest.importorskip("wandb")

BLOCK = 32768
HEADER = 7  # file header ":W&B" + magic 0xBEE1 + version; each record header: crc32c, length, type


def read_wandb_records(path: Path):
    """The records of a W&B transaction log (LevelDB-log framing of protobuf `Record`s), parsed
    here from the format so the test does not trust the code that wrote them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer: zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += room  # rest of the block is padding
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:  # FULL
            pending = chunk
        elif kind == 2:  # FIRST
            pending = chunk
            continue
        elif kind == 3:  # MIDDLE
            pending += chunk
            continue
        else:  # LAST
            pending += chunk
        rec = pb.Record()
        rec.ParseFromString(pending)
        records.append(rec)
        pending = b""
    return records


def _history(records):
    rows = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in rec.history.item}
            rows.append(row)
    return rows


def _config(records):
    """The run's config: attached to its `run` record, updated by later `config` records."""
    out = {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key] = json.loads(item.value_json)
    return out


def test_offline_run_holds_logged_values_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # the explicit mode must win over the environment
    cfg = {"algo": {"lr": 1e-5, "policy_loss": "ppo"}, "name": "t"}
    logged = {1: {"reward/mean": 0.25, "timing/step": 1.5},
              2: {"reward/mean": 0.5, "train/grad_norm": 2.0, "train/kl": float("nan")},
              3: {"reward/mean": 0.75, "timing/step": 1.25}}
    with pytest.warns(RuntimeWarning, match="train/kl"):
        with MetricsLogger(tmp_path, tensorboard=False, enabled=True, wandb=True, wandb_project="dsrl-test",
                           wandb_mode="offline", config=cfg, name="t") as log:
            assert log.wandb.mode == "offline"
            for step, metrics in logged.items():
                log.log(step, metrics)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").rglob("*"))
    records = read_wandb_records(runs[0])
    rows = _history(records)
    assert [r["_step"] for r in rows] == [1, 2, 3], [r.WhichOneof("record_type") for r in records]
    for row, (step, metrics) in zip(rows, logged.items()):
        for key, value in metrics.items():
            if math.isnan(value):
                assert row[key] == "NaN" or math.isnan(float(row[key]))
            else:
                assert row[key] == value, (step, key)
    config = _config(records)
    assert config["algo"] == cfg["algo"] and config["name"] == "t"
    # jsonl is still written alongside
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def _run_record(path: Path):
    return next(r.run for r in read_wandb_records(path) if r.WhichOneof("record_type") == "run")


def test_a_resumed_logger_continues_the_wandb_run(tmp_path):
    """A run logs steps 1..5 and dies; its last checkpoint (of step 3) kept the W&B run's id. The
    resumed logger continues that run: the same id, no other run, steps 4..6 logged once more and
    nothing of 1..3 sent again. Offline, W&B writes the continuation in a folder of its own (one
    per process) under the same id, marked as a resume; `wandb sync` appends it to the run."""
    crashed = MetricsLogger(tmp_path, tensorboard=False, enabled=True, wandb=True, wandb_mode="offline")
    assert crashed.wandb_run_id is None  # nothing started before the first log
    for step in range(1, 6):
        crashed.log(step, {"reward/mean": float(step)})
    run_id, first_dir = crashed.wandb_run_id, crashed.wandb.run_dir
    kept = crashed.history[:3]
    crashed.close()

    resumed = MetricsLogger(tmp_path, tensorboard=False, enabled=True, wandb=True, wandb_mode="offline")
    resumed.restore(kept, step=3, wandb_run_id=run_id)
    assert resumed.wandb_run_id == run_id
    for step in (4, 5, 6):
        resumed.log(step, {"reward/mean": 10.0 * step})
    second_dir = resumed.wandb.run_dir
    resumed.close()

    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert {f.parent for f in files} == {first_dir, second_dir} and first_dir != second_dir
    assert {_run_record(f).run_id for f in files} == {run_id}  # no second run
    assert not _run_record(first_dir / f"run-{run_id}.wandb").resume
    assert _run_record(second_dir / f"run-{run_id}.wandb").resume
    rows = _history(read_wandb_records(second_dir / f"run-{run_id}.wandb"))
    assert [(r["_step"], r["reward/mean"]) for r in rows] == [(4, 40.0), (5, 50.0), (6, 60.0)]
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4, 5, 6]


def test_from_config_passes_logger_settings(tmp_path):
    from dsrl.config.schema import Config

    cfg = Config()
    cfg.logger.tensorboard = False
    log = MetricsLogger.from_config(tmp_path, cfg)
    try:
        assert log.wandb is None and log._writer is None
    finally:
        log.close()
    cfg.logger.wandb, cfg.logger.wandb_mode = True, "offline"
    with MetricsLogger.from_config(tmp_path, cfg) as log:
        assert log.wandb is not None and log.wandb.mode == "offline"
        log.log(1, {"reward/mean": 1.0})
    records = read_wandb_records(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")))
    assert _history(records)[0]["reward/mean"] == 1.0
    assert _config(records)["logger"]["wandb_mode"] == "offline"


def test_disabled_rank_starts_no_wandb_run(tmp_path):
    log = MetricsLogger(tmp_path / "run", enabled=False, wandb=True, wandb_mode="offline")
    assert log.wandb is None and log.log(1, {"x": 1.0}) is None
    log.close()
    assert not (tmp_path / "run").exists()


@pytest.fixture
def no_key(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    return netrc


def test_auto_without_key_is_offline_and_touches_no_network(no_key, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("network touched without an API key")

    monkeypatch.setattr(socket, "create_connection", no_network)
    assert resolve_wandb_mode("auto") == ("offline", "no W&B API key configured (WANDB_API_KEY or `wandb login`)")
    assert resolve_wandb_mode("offline")[0] == "offline" and resolve_wandb_mode("online")[0] == "online"
    with pytest.raises(ValueError, match="logger.wandb_mode='cloud'"):
        resolve_wandb_mode("cloud")


def test_key_sources(no_key, monkeypatch):
    assert not wandb_api_key_configured()
    no_key.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert wandb_api_key_configured()
    assert not wandb_api_key_configured("https://wandb.example.org")
    no_key.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_api_key_configured()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_auto_with_key_depends_on_the_host_answering(no_key, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    closed = _free_port()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    mode, why = resolve_wandb_mode("auto", timeout=2.0)
    assert mode == "offline" and "not reachable" in why
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert resolve_wandb_mode("auto", timeout=2.0)[0] == "online"


def test_reachability_gives_up_on_a_hanging_resolver(monkeypatch):
    release, finished = threading.Event(), threading.Event()

    def hang(*a, **k):  # a resolver that never answers (until the test lets it go)
        release.wait()
        finished.set()
        raise OSError("released")

    monkeypatch.setattr(wandb_sink.socket, "create_connection", hang)
    try:
        assert wandb_host_reachable("https://api.wandb.ai", timeout=0.5) is False
        assert not finished.is_set()  # returned while the connection attempt was still hanging
    finally:
        release.set()
