"""The documentation's commands are real: every command line of a runnable block (README.md, docs/)
composes with Hydra and passes dsrl's validation without loading a model, its `make` target exists,
and the blocks marked `<!-- runnable: e2e -->` run end to end for one step on the tiny model.

A renamed key, a removed preset or a batch size the launch's ranks cannot split fails here."""
from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dsrl.config.schema import register_configs, to_config
from dsrl.validation.validate import validate
from doc_commands import ROOT, DocCommand, doc_commands, make_recipes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_jobs import job_env, metric_rows  # noqa: E402  (the e2e tests' job helpers)

register_configs()
COMMANDS = doc_commands()
# One step of the tiny model, put after a documented command's own overrides (the last one wins).
TINY_ONE_STEP = ["model.path=tiny", "model.dtype=float32", "rollout.dtype=float32", "trainer.total_steps=1",
                 "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=2", "algo.global_batch_size=4",
                 "rollout.max_new_tokens=8", "trainer.eval_before=false", "trainer.eval_after=false",
                 "trainer.save_every=0", "trainer.save_final=false", "logger.plot=false",
                 "logger.tensorboard=false", "logger.progress=false"]


def _ids(cmds):
    return [c.page for c in cmds]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])


def test_the_docs_have_runnable_commands():
    """The extraction finds the guides' commands (a marker that stopped matching would pass everything)."""
    pages = {c.page.split(":")[0] for c in COMMANDS}
    assert {"docs/quickstart.md", "docs/guides/own-data.md", "docs/guides/multi-node.md"} <= pages
    assert any(c.e2e for c in COMMANDS)
    assert any(c.world_size > 1 for c in COMMANDS)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind in ("main", "serve") and not c.cli_only],
                         ids=_ids([c for c in COMMANDS if c.kind in ("main", "serve") and not c.cli_only]))
def test_command_composes_and_validates(cmd: DocCommand, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(cmd.world_size))
    monkeypatch.syspath_prepend(str(ROOT))  # dotted paths such as examples.own_data.rewards.fn
    monkeypatch.chdir(ROOT)
    cfg = to_config(_compose(cmd.overrides))
    validate(cfg)
    if cmd.kind == "serve":
        from dsrl.serve.config import serve_errors

        assert not serve_errors(cfg), f"{cmd.page}: {cmd.line}"
    if cfg.reward.fn:
        from dsrl.reward.registry import get_verifier

        get_verifier(cfg.reward.fn)  # the named reward function loads and has a verifier's signature
    if cfg.data.path:
        assert glob.glob(str(ROOT / cfg.data.path)), f"{cmd.page}: data.path={cfg.data.path} does not exist"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "make"], ids=_ids([c for c in COMMANDS if c.kind == "make"]))
def test_make_target_exists(cmd: DocCommand):
    assert cmd.make_target in make_recipes(), f"{cmd.page}: `{cmd.line}`: no such Makefile target"


def test_no_runnable_line_is_left_unchecked():
    """Every line of a runnable block is one of the forms checked above."""
    other = [f"{c.page}: {c.line}" for c in COMMANDS if c.kind == "other"]
    assert not other, "runnable lines the test cannot check (move them out of the marked block):\n" + "\n".join(other)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.cli_only], ids=_ids([c for c in COMMANDS if c.cli_only]))
def test_cli_only_command_runs(cmd: DocCommand):
    """`--help` / `--cfg job` run the real entry point (Hydra's side: nothing loads)."""
    out = subprocess.run([sys.executable, "-m", f"dsrl.{cmd.kind}", *cmd.overrides], cwd=ROOT, env=job_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rollout:" in out.stdout and "algo:" in out.stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.e2e], ids=_ids([c for c in COMMANDS if c.e2e]))
def test_e2e_command_trains_one_step(cmd: DocCommand, tmp_path: Path):
    """The documented command, shrunk to one step of the tiny model, runs to its summary."""
    assert cmd.kind == "main" and cmd.world_size == 1, f"{cmd.page}: only single-process dsrl.main lines run e2e"
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "dsrl.main", *cmd.overrides, *TINY_ONE_STEP,
                          f"hydra.run.dir={run_dir}"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:]
    rows = metric_rows(run_dir)
    assert len(rows) == 1 and "reward/mean" in rows[0]
    # The console (stdout and stderr as a terminal shows them) ends with dsrl's summary line: what
    # the interpreter's teardown prints goes to run.log.
    tail = [line for line in out.stdout.splitlines() if line.strip()]
    assert "summary:" in tail[-1], tail[-5:]
    assert "nanobind" not in out.stdout
