"""Non-finite steps on the real DeepSpeed engine (tiny Llama, float32, ZeRO 0-3): a microbatch
whose loss is NaN -- with NaN gradients, or with finite gradients (a NaN constant in the loss)
-- makes optimizer_step() skip: weights and optimizer state stay bit-identical, the gradients are
dropped, and the next normal step equals that same step taken without the bad one (bit-exact).
Two ranks where only one sees the NaN: both skip. The trainer stops with TrainingDiverged after
trainer.max_skipped_steps skips in a row and counts train/skipped_steps."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from dsrl.actor.engine import ActorEngine
from dsrl.actor.nonfinite import SkipCounter, TrainingDiverged
from dsrl.distributed.ports import free_port
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.testing import random_microbatch

pytestmark = pytest.mark.slow

PPO = get_objective("ppo")


def _nan_constant_loss(inputs):
    """PPO plus a detached NaN: the loss is NaN, its gradient is PPO's (finite)."""
    out = PPO.fn(inputs)
    return dataclasses.replace(out, loss=out.loss + torch.tensor(float("nan")))


def _nan_gradient_loss(inputs):
    """PPO plus sqrt(|0 * sum(log_probs)|): the value adds exactly 0 (the loss stays finite), the
    gradient is 0 * inf = NaN on every parameter the log-probs depend on."""
    out = PPO.fn(inputs)
    return dataclasses.replace(out, loss=out.loss + (inputs.log_probs.sum() * 0.0).abs().sqrt())


NAN_LOSS_FINITE_GRAD = dataclasses.replace(PPO, name="nan_constant", fn=_nan_constant_loss)
NAN_GRAD_FINITE_LOSS = dataclasses.replace(PPO, name="nan_gradient", fn=_nan_gradient_loss)


def _mb(seed: int) -> dict:
    """Three random samples with random advantages (dsrl.testing.random_microbatch)."""
    return random_microbatch(seed, [(5, 4), (7, 2), (4, 6)])


def _step(eng: ActorEngine, mbs: list, objectives: list | None = None) -> float:
    """forward_backward every microbatch (the last one closes the accumulation), then the step."""
    objectives = objectives or [PPO] * len(mbs)
    eng.weights_pushed()  # a new rollout from these weights (reuse refuses steps since the last push)
    for i, (mb, obj) in enumerate(zip(mbs, objectives)):
        reduce = Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))
        eng.forward_backward(mb, obj, {}, reduce, reuse_training_logprobs=True, is_last=i == len(mbs) - 1)
    return eng.optimizer_step()


def _params(eng: ActorEngine) -> dict:
    return eng.state_dict_for_export()


def _optimizer_state(eng: ActorEngine) -> list:
    """Every tensor of the torch optimizer DeepSpeed drives, per parameter it holds state for:
    the parameter itself (ZeRO: the fp32 master partition) and its state (step, moments)."""
    opt = eng.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out = []
    for p, st in inner.state.items():
        out.append(p.detach().clone())
        for _, v in sorted(st.items()):
            out.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
    return out


def _assert_equal(a, b, what: str):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
    else:
        assert len(a) == len(b) and len(a) > 0, what
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{what}: tensor #{i} differs"


def _engine(model_path, stage: int) -> ActorEngine:
    torch.manual_seed(0)
    return ActorEngine(str(model_path), zero_stage=stage, micro_batch_size=3, lr=1e-2, grad_clip=1.0,
                       persistence_threshold=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_step_is_skipped_and_leaves_no_trace(tiny_model_path, stage):
    eng = _engine(tiny_model_path, stage)
    assert math.isfinite(_step(eng, [_mb(1)])) and not eng.last_step_skipped  # optimizer state exists now
    params, state = _params(eng), _optimizer_state(eng)
    assert any(float(t.abs().sum()) > 0 for t in state[1:])  # moments are non-zero: a real check

    # Finite loss, NaN gradients, in the second of two microbatches: only the gradient check sees it.
    norm = _step(eng, [_mb(2), _mb(3)], [PPO, NAN_GRAD_FINITE_LOSS])
    assert eng.last_step_skipped and math.isnan(norm)
    _assert_equal(_params(eng), params, "weights after a NaN-gradient step")
    _assert_equal(_optimizer_state(eng), state, "optimizer state after a NaN-gradient step")

    # NaN loss, finite gradients, in the first microbatch: only the loss check sees it.
    _step(eng, [_mb(4), _mb(5)], [NAN_LOSS_FINITE_GRAD, PPO])
    assert eng.last_step_skipped
    _assert_equal(_params(eng), params, "weights after a NaN-loss step")
    _assert_equal(_optimizer_state(eng), state, "optimizer state after a NaN-loss step")

    # The next normal step: exactly the step a fresh engine takes without the bad ones.
    assert math.isfinite(_step(eng, [_mb(6)])) and not eng.last_step_skipped
    after_bad = _params(eng)
    ref = _engine(tiny_model_path, stage)
    _step(ref, [_mb(1)])
    _step(ref, [_mb(6)])
    _assert_equal(after_bad, _params(ref), "the step after the skipped ones vs the same step without them")
    _assert_equal(_optimizer_state(eng), _optimizer_state(ref), "optimizer state vs the clean run")
    assert not torch.equal(after_bad["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_skip_counter_stops_after_max_in_a_row():
    c = SkipCounter(3)
    for skipped in (True, True, False, True, True):  # a good step resets the run
        c.record(skipped, 7)
    assert (c.total, c.consecutive) == (4, 2)
    with pytest.raises(TrainingDiverged, match=r"at step 7: 3 optimizer steps in a row.*max_skipped_steps=3") as e:
        c.record(True, 7)
    assert (e.value.step, e.value.consecutive, e.value.total) == (7, 3, 5)
    restored = SkipCounter(3)
    restored.load_state_dict(c.state_dict())
    assert (restored.total, restored.consecutive) == (5, 3)
    with pytest.raises(ValueError, match="trainer.max_skipped_steps=0"):
        SkipCounter(0)


# ---------------------------------------------------------------------- through the trainer
def _trainer_helpers():
    """The real-engine trainer helpers of tests/trainer (a sibling test folder, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "trainer" / "_real_engine.py"
    spec = importlib.util.spec_from_file_location("_real_engine_for_nonfinite", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_engine, mod.make_cfg, mod.make_samples, mod.make_trainer


def test_trainer_counts_skips_and_stops_after_max_in_a_row(tiny_model_path, tiny_tokenizer, tmp_path):
    build_engine, make_cfg, make_samples, make_trainer = _trainer_helpers()
    cfg = make_cfg(tiny_model_path)
    cfg.trainer = dataclasses.replace(cfg.trainer, max_skipped_steps=2)
    actor = build_engine(tiny_model_path)
    samples = make_samples(tiny_tokenizer, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    trainer = make_trainer(cfg, actor, tiny_tokenizer, tmp_path, samples=samples)
    m1 = trainer.step(1)
    assert m1["train/skipped_steps"] == 0.0 and math.isfinite(m1["train/grad_norm"])
    good = _params(actor)
    trainer.policy.objective = NAN_LOSS_FINITE_GRAD  # the run's objective from now on: every step non-finite
    m2 = trainer.step(2)
    assert m2["train/skipped_steps"] == 1.0 and math.isnan(m2["train/grad_norm"])
    _assert_equal(_params(actor), good, "weights after a skipped trainer step")
    with pytest.raises(TrainingDiverged, match="at step 3: 2 optimizer steps in a row") as e:
        trainer.step(3)
    assert e.value.step == 3
    _assert_equal(_params(actor), good, "weights when the run stops: the last good state")


# ---------------------------------------------------------------------- two ranks
def _two_rank_worker(rank: int, world: int, port: int, model_path: str, out_dir: str, stages) -> None:
    """Only rank 1 sees the bad microbatch (a NaN loss with finite gradients, then a finite loss
    with NaN gradients): both ranks must skip and stay identical."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    for stage in stages:
        eng = _engine(model_path, stage)
        _step(eng, [_mb(10 + rank)])
        before = _params(eng)
        results = {"before": before}
        _step(eng, [_mb(20 + rank)], [NAN_LOSS_FINITE_GRAD if rank == 1 else PPO])
        results["skipped_nan_loss"] = eng.last_step_skipped
        results["after_nan_loss"] = _params(eng)
        _step(eng, [_mb(30 + rank)], [NAN_GRAD_FINITE_LOSS if rank == 1 else PPO])
        results["skipped_nan_grad"] = eng.last_step_skipped
        results["after_nan_grad"] = _params(eng)
        _step(eng, [_mb(40 + rank)])
        results["skipped_good"] = eng.last_step_skipped
        results["after_good"] = _params(eng)
        torch.save(results, os.path.join(out_dir, f"zero{stage}_rank{rank}.pt"))
        torch.distributed.barrier()
        del eng


def test_two_ranks_skip_together_when_one_rank_sees_nan(tiny_model_path, tmp_path):
    import torch.multiprocessing as mp

    stages = (0, 2, 3)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_rank_worker, args=(r, 2, port, str(tiny_model_path), str(tmp_path), stages))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for stage in stages:
        r0, r1 = (torch.load(os.path.join(str(tmp_path), f"zero{stage}_rank{r}.pt")) for r in (0, 1))
        for r in (r0, r1):
            assert r["skipped_nan_loss"] and r["skipped_nan_grad"] and not r["skipped_good"], stage
            _assert_equal(r["after_nan_loss"], r["before"], f"ZeRO-{stage} weights after rank 1's NaN loss")
            _assert_equal(r["after_nan_grad"], r["before"], f"ZeRO-{stage} weights after rank 1's NaN gradient")
        # replicas: both ranks apply the same all-reduced gradient
        _assert_equal(r0["after_good"], r1["after_good"], f"ZeRO-{stage} ranks after the next good step")
        assert not torch.equal(r0["after_good"]["model.norm.weight"], r0["before"]["model.norm.weight"])
