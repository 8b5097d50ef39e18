"""The loop as stages trains what the one-class trainer before it trained: one seed gives the same
`metrics.jsonl` (timings aside) and the same final weights, bit for bit, from the code of the last
commit before the stages refactor and from this checkout (real vLLM + DeepSpeed).

The reference is commit REFERENCE (the 604-line `Trainer`) with one file taken from SCHEDULING_FIX:
`dsrl/rollout/vllm_worker.py`, whose engine calls add every request before vLLM's engine core steps.
Without it a bf16 run does not even equal itself (the batches vLLM formed depended on timing), so
there would be nothing to compare; the file is the same at REFERENCE and at the fix's parent, and
the fix changes no other file of the training path.

Two jobs: the tiny model in float32 (4 steps, a checkpoint every step: the session's uninterrupted
run, which the resume test also uses) and the default job (`+exp=grpo_reuse`: SmolLM2, dtypes by
`auto`, so bf16 where the CPU has it natively) for 2 steps with evals off."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsrl.setup_assets import default_cache_dir
from e2e_jobs import UNINTERRUPTED, job_cmd, job_env, untimed_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REFERENCE = "0a2d8307f7899020f1e4c1be76098118c1cb96cd"  # the last commit with the one-class trainer
SCHEDULING_FIX = "3d7d955ab06809c863acab0ccae140da0f936128"  # vLLM: requests in before the engine steps
REPO = Path(__file__).resolve().parents[2]
# What `+exp=grpo_reuse` sets differently since REFERENCE, given to the reference job explicitly so
# that both run one configuration (the knob exists at REFERENCE): the default job's token budget.
CHANGED_DEFAULTS = ["actor.max_tokens_per_microbatch=1024"]
PROBE = "rollout/sync_logprob_diff"
DEFAULT_JOB = ["+exp=grpo_reuse", "trainer.total_steps=2", "trainer.eval_before=false", "trainer.eval_after=false",
               "logger.plot=false"]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)


@pytest.fixture(scope="module")
def reference_tree(tmp_path_factory) -> Path:
    """The reference code (`dsrl/` and `conf/` of REFERENCE, with SCHEDULING_FIX's vllm_worker.py)."""
    if _git("cat-file", "-e", f"{REFERENCE}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {REFERENCE[:7]} is not in this checkout's history (a shallow clone?)")
    tree = tmp_path_factory.mktemp("reference")
    archive = _git("archive", "--format=tar", REFERENCE, "dsrl", "conf")
    assert archive.returncode == 0, archive.stderr
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    fixed = _git("show", f"{SCHEDULING_FIX}:dsrl/rollout/vllm_worker.py")
    assert fixed.returncode == 0, fixed.stderr
    (tree / "dsrl" / "rollout" / "vllm_worker.py").write_bytes(fixed.stdout)
    return tree


def _run_reference(tree: Path, run_dir: Path, *overrides: str) -> None:
    """The CLI job on the reference code: its tree first on the path, the checkout's model cache.
    TORCHDYNAMO_DISABLE does for its engines what dsrl's CPU engines now do themselves
    (vllm_engine.eager_sampler_ops): vLLM's sampler not compiled at the first generate, the same
    tokens and log-probs bit for bit (tests/rollout/test_engine_host.py), seconds less per engine."""
    env = job_env(PYTHONPATH=str(tree), DSRL_CACHE=str(default_cache_dir()), TORCHDYNAMO_DISABLE="1")
    where = subprocess.run([sys.executable, "-c", "import dsrl; print(dsrl.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(tree), f"the reference job would import {where}"
    r = subprocess.run(job_cmd(run_dir, *overrides), cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


def _run_here(run_dir: Path, *overrides: str) -> None:
    r = subprocess.run(job_cmd(run_dir, *overrides), cwd=REPO, env=job_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


def _assert_same_run(ref: Path, now: Path) -> None:
    a, b = untimed_metrics(ref), untimed_metrics(now)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        # the reference probed every push; now the probe runs on the first and every 32nd
        # (rollout.sync_probe_every=null, auto) and reads only: the other readings are not compared
        if PROBE in ra and PROBE not in rb:
            del ra[PROBE]
        assert ra.keys() == rb.keys(), (ra["step"], sorted(set(ra) ^ set(rb)))
        diff = {k: (ra[k], rb[k]) for k in ra if ra[k] != rb[k]}
        assert not diff, f"step {ra['step']}: reference vs now {diff}"
    wa = load_file(str(ref / "final_model" / "model.safetensors"))
    wb = load_file(str(now / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if wa[k].dtype != wb[k].dtype or not torch.equal(wa[k], wb[k])]
    assert not differ, f"final weights differ in {differ[:5]} ({len(differ)} tensors)"


def test_tiny_float32_job_equals_the_one_class_trainer(tmp_path, reference_tree, uninterrupted_tiny_run):
    _run_reference(reference_tree, tmp_path / "ref", *UNINTERRUPTED, *CHANGED_DEFAULTS)
    _assert_same_run(tmp_path / "ref", uninterrupted_tiny_run)


def test_default_job_equals_the_one_class_trainer(tmp_path, reference_tree, smollm2_path):
    _run_reference(reference_tree, tmp_path / "ref", *DEFAULT_JOB, *CHANGED_DEFAULTS)
    _run_here(tmp_path / "now", *DEFAULT_JOB)
    _assert_same_run(tmp_path / "ref", tmp_path / "now")
