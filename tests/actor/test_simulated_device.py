"""dsrl's code around its engines, run on a simulated accelerator (dsrl.testing.simdevice): a
device whose tensors fail any op with a host tensor of one or more dimensions, as CUDA does.

Each engine case runs twice on the same engine: on the CPU, then on the simulated device. On the
device it must not fail (nothing dsrl builds for an objective, a reducer or a metric may stay on
the host), its results must live on the device (the check is real: the objective ran there), and
loss, metrics and every parameter gradient must equal the CPU run bit for bit (the simulated
device runs the same CPU kernels on the same shapes). Before the engines built their reducers
(dsrl.loss.types.Reduction), every case that reduces failed here with "Expected all tensors to
be on the same device ... meta (simulated accelerator) and cpu! (in aten.mul.Tensor ...)" at the
reducer's `per_seq * seq_weight`, which is how the CUDA path crashed on its first microbatch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsrl.loss.registry import get_objective
from dsrl.loss.types import Aggregator, Reduction
from dsrl.rollout.samples import pack_microbatches
from dsrl.testing import engine_cases as cases
from dsrl.testing.simdevice import SIM, host_data, is_sim, on_simulated_device, simulated_accelerator


# ---------------------------------------------------------------------- the device itself
def test_device_and_host_tensors_do_not_mix_but_scalars_do():
    with simulated_accelerator():
        x = torch.arange(3.0).to(SIM)
        assert is_sim(x) and x.device == SIM
        with pytest.raises(RuntimeError, match="same device"):
            x * torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(1) + x  # one element, but one dimension: CUDA refuses it too
        y = x * torch.tensor(2.0) + 1  # a 0-dim host tensor and a Python number are fine
        assert is_sim(y) and y.tolist() == [1.0, 3.0, 5.0] and float(y.sum()) == 9.0
        assert not is_sim(y.cpu()) and torch.equal(y.cpu(), torch.tensor([1.0, 3.0, 5.0]))
        with pytest.raises(TypeError, match="numpy"):
            y.numpy()
        z = torch.zeros(2, device=x.device)  # a factory on the device's name
        assert is_sim(z) and is_sim(torch.zeros_like(x)) and is_sim(x.new_ones(4))


def test_moves_are_differentiable_and_backward_runs_on_the_device():
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)  # a host parameter
    with simulated_accelerator():
        mask = torch.tensor([1.0, 0.0, 1.0]).to(SIM)
        # w^2 * mask = [0.25, 0, 4], clamped to 3: d/dw = [2 * 0.5, 0 (masked), 0 (clamped)]; clamp's
        # backward builds a zero on the grad's device, which must hold data there.
        loss = ((w.to(SIM) ** 2) * mask).clamp(max=3.0).sum()
        assert is_sim(loss)
        loss.backward()
    assert not is_sim(w.grad) and torch.equal(w.grad, torch.tensor([1.0, 0.0, 0.0]))


def test_perturbed_weights_on_the_device_move_as_on_the_host():
    """dsrl.testing.perturb_weights (the GPU smoke's stale-layer check moves a CUDA trainer's layer
    with it) draws its noise on the host and moves it to each weight's device: the same move
    there as on the CPU. Drawn without the move, the add raises CUDA's device error."""
    from dsrl.testing import perturb_weights

    host = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    expected = host.clone()
    perturb_weights([expected], 0.1, seed=7)
    assert not torch.equal(expected, host)
    with simulated_accelerator():
        w = host.clone().to(SIM)
        perturb_weights([w], 0.1, seed=7)
        assert is_sim(w) and torch.equal(host_data(w), expected)
        with pytest.raises(RuntimeError, match="same device"):
            w.add_(0.1 * w.float().std() * torch.randn(w.shape))


def test_a_reducer_built_on_the_host_fails_there_and_one_built_from_the_device_mask_works():
    """The defect the engines had: the Aggregator built from the host loss mask, the log-probs
    on the device."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, 9.0], [-4.0, 9.0, 9.0]])
    with simulated_accelerator():
        host_reduce = Aggregator.build("token-mean", mask, global_tokens=3)
        with pytest.raises(RuntimeError, match="same device"):
            host_reduce(lp.to(SIM))
        reduce = Reduction("token-mean", global_tokens=3).build(mask.to(SIM))
        got = reduce(lp.to(SIM))
        assert is_sim(got) and float(got) == pytest.approx(-7.0 / 3)


# ---------------------------------------------------------------------- engines on the device
def _samples(seed: int = 0) -> list:
    return cases.samples(seed)


def _fields(batch, seed: int = 1) -> dict:
    return cases.fields(batch, seed)


def _mbs(layout: str, batch, token_fields) -> list:
    return cases.microbatches(layout, batch, token_fields)


def _grads(module) -> list:
    out = [p.grad.detach().clone() if p.grad is not None else None for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return out


def _assert_same_run(cpu, sim):
    """(outputs, grads) of the CPU run and of the simulated-device run: equal bit for bit; the
    device run's results on the device."""
    (outs_c, grads_c), (outs_s, grads_s) = cpu, sim
    assert len(outs_c) == len(outs_s)
    for a, b in zip(outs_c, outs_s):
        assert is_sim(b.loss) and not is_sim(a.loss)
        assert torch.equal(a.loss, host_data(b.loss))
        assert set(a.metrics) == set(b.metrics) and a.metrics
        for k in a.metrics:
            assert is_sim(b.metrics[k]), k
            assert torch.equal(torch.as_tensor(a.metrics[k]), host_data(b.metrics[k])), k
    assert any(g is not None and g.abs().sum() > 0 for g in grads_c)
    for x, y in zip(grads_c, grads_s):
        assert (x is None) == (y is None)
        if x is not None:
            assert not is_sim(y) and torch.equal(x, y)


def _twice(owner, run, *, attr="engine"):
    """run() on the CPU, then on the simulated device."""
    cpu = run()
    with on_simulated_device(owner, attr=attr):
        sim = run()
    return cpu, sim


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from dsrl.actor.engine import ActorEngine

    torch.manual_seed(0)
    return ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1e-3, grad_clip=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", cases.LAYOUTS)
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_every_objective_runs_on_the_device_and_equals_the_cpu_run(actor, case, layout):
    batch = _samples()

    def run():
        outs = cases.run_case(actor, case, layout, batch)
        assert len(outs) > 1 if layout.endswith("budget") else len(outs) >= 1
        return outs, _grads(actor.module)

    cpu, sim = _twice(actor, run)
    _assert_same_run(cpu, sim)
    # The weight-push check's inputs (rollout/abs_diff_sum) come from the device run too.
    assert "rollout/abs_diff_sum" in sim[0][0].metrics


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dense", "shared"])
def test_forward_only_scoring_returns_host_log_probs_equal_to_the_cpu_pass(actor, layout):
    samples = _samples(seed=3)

    def run():
        return actor.score(_mbs(layout, samples, {}))

    cpu, sim = _twice(actor, run)
    assert len(cpu) == len(sim) > 0
    for a, b in zip(cpu, sim):
        assert not is_sim(b) and torch.equal(a, b)  # the trainer keeps scored log-probs on the host


@pytest.mark.slow
def test_an_optimizer_step_after_device_microbatches_lands_where_the_cpu_one_does(tiny_model_path):
    from dsrl.actor.engine import ActorEngine

    samples = _samples(seed=4)
    fields = _fields(samples, seed=5)
    reduction = Reduction("token-mean", global_tokens=float(sum(len(s.response_ids) for s in samples)))
    after = []
    for on_device in (False, True):
        torch.manual_seed(0)
        eng = ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1e-2, grad_clip=1.0)

        def step():
            mbs = _mbs("shared", samples, fields)
            for i, mb in enumerate(mbs):
                eng.forward_backward(mb, get_objective("ppo"), {}, reduction, reuse_training_logprobs=True,
                                     is_last=i == len(mbs) - 1)
            return eng.optimizer_step()

        if on_device:
            with on_simulated_device(eng):
                norm = step()
        else:
            norm = step()
        after.append((norm, [p.detach().clone() for p in eng.module.parameters()]))
    (n0, p0), (n1, p1) = after
    assert n0 == n1 > 0 and all(torch.equal(a, b) for a, b in zip(p0, p1))


@pytest.mark.slow
def test_lora_actor_trains_on_the_device(tiny_model_path):
    from types import SimpleNamespace

    from dsrl.actor.engine import ActorEngine

    torch.manual_seed(0)
    lora = SimpleNamespace(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"], dropout=0.0)
    eng = ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1e-2, lora=lora)
    samples = _samples(seed=6)
    fields = _fields(samples, seed=7)
    reduction = Reduction("token-mean", global_tokens=float(sum(len(s.response_ids) for s in samples)))

    def run():
        mbs = _mbs("dense", samples, fields)
        outs = [eng.forward_backward(mb, get_objective("ppo"), {}, reduction, reuse_training_logprobs=True,
                                     is_last=i == len(mbs) - 1) for i, mb in enumerate(mbs)]
        return outs, _grads(eng.module)

    _assert_same_run(*_twice(eng, run))


# ---------------------------------------------------------------------- the critic
@pytest.mark.slow
def test_critic_values_and_value_loss_step_on_the_device(tiny_model_path):
    from dsrl.actor.batch import masked_rows
    from dsrl.actor.critic import CriticEngine

    samples = _samples(seed=8)
    results = []
    for on_device in (False, True):
        torch.manual_seed(0)
        critic = CriticEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1.0, eps=10.0,
                              grad_clip=0.0)

        def run():
            mbs = _mbs("shared", samples, {})
            old = critic.values(mbs)
            assert all(not is_sim(v) for v in old)  # values come back to the host (GAE reads them)
            rows = [r for v, mb in zip(old, mbs) for r in masked_rows(v, mb["loss_mask"])]
            g = torch.Generator().manual_seed(9)
            fields = {"old_values": rows, "returns": [r + torch.randn(r.shape, generator=g) for r in rows],
                      "advantages": [torch.randn(r.shape, generator=g) for r in rows]}
            train = pack_microbatches(samples, 3, 0, fields, shared_prompt=True)
            reduction = Reduction("token-mean", global_tokens=float(sum(len(s.response_ids) for s in samples)))
            metrics = critic.train_step(train, {"value_clip": 0.2, "value_loss_coef": 1.0}, reduction)
            return old, metrics, [p.detach().clone() for p in critic.module.parameters()]

        if on_device:
            with on_simulated_device(critic):
                results.append(run())
        else:
            results.append(run())
    (v0, m0, p0), (v1, m1, p1) = results
    assert all(torch.equal(a, b) for a, b in zip(v0, v1))
    assert m0.keys() == m1.keys() and all(m0[k] == m1[k] for k in m0), (m0, m1)
    assert m0["critic/grad_norm"] > 0 and all(torch.equal(a, b) for a, b in zip(p0, p1))


# ---------------------------------------------------------------------- Tinker work units
def reduced_square(inputs):
    """A server-side custom loss that reduces with the engine's reducer (`inputs.reduce`)."""
    return inputs.reduce(inputs.log_probs ** 2 * inputs.batch["loss_weights"])


reduced_square.required_inputs = ("weights",)


def _datums(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = 4 + i % 3
        tokens = torch.randint(10, 1000, (L + 1,), generator=g)
        out.append({"model_input": tokens[:-1].tolist(),
                    "loss_fn_inputs": {"target_tokens": tokens[1:].tolist(),
                                       "weights": (torch.rand(L, generator=g) > 0.2).float().tolist(),
                                       "advantages": torch.randn(L, generator=g).tolist(),
                                       "logprobs": (-torch.rand(L, generator=g)).tolist()}})
    return out


def _session_runs(session, data, custom):
    from dsrl.serve.objectives import ObjectiveTable

    table = ObjectiveTable({"sq": f"{__name__}.reduced_square"})
    resolved = table.resolve("custom", {"loss_id": "sq"})
    outs = [session.forward_backward(data, "cross_entropy"), session.forward_backward(data, "ppo")]
    prepared = session.validate(data, "cross_entropy", resolved.required)
    outs.append(session.run_prepared(prepared, resolved.spec, resolved.config, forward_only=False))
    return outs


def _assert_same_units(cpu, sim):
    for a, b in zip(cpu, sim):
        assert a.metrics == b.metrics
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            assert x.keys() == y.keys()
            for k in x:  # per-datum outputs reach the client as host tensors
                assert not is_sim(y[k]) and torch.equal(x[k], y[k]), k


@pytest.mark.slow
def test_tinker_work_units_and_a_custom_reducing_loss_on_the_device(actor):
    from dsrl.actor.work_units import TrainingSession

    session = TrainingSession(actor, micro_batch_size=2)
    data = _datums(5, seed=10)

    def run():
        outs = _session_runs(session, data, custom=True)
        return outs, _grads(actor.module)

    (c_outs, c_grads), (s_outs, s_grads) = _twice(actor, run)
    _assert_same_units(c_outs, s_outs)
    assert any(g is not None and g.abs().sum() > 0 for g in c_grads)
    assert all(torch.equal(x, y) for x, y in zip(c_grads, s_grads) if x is not None)


@pytest.mark.slow
def test_the_services_lora_pool_trains_on_its_device(tiny_model_path):
    from dsrl.serve.lora import LoraPool, LoraSpec

    pool = LoraPool(str(tiny_model_path), dtype=torch.float32, attn_implementation="eager", micro_batch_size=2,
                    pad_id=0)
    pool.add_slot("a", LoraSpec(rank=2, alpha=8.0, seed=0))
    pool.add_slot("b", LoraSpec(rank=4, alpha=8.0, seed=1))
    data = _datums(4, seed=11)
    prepared = pool.session.validate(data, "ppo")
    from dsrl.loss import tinker

    spec, config = get_objective(tinker.tinker_objective_name("ppo")), tinker.resolve_config("ppo", {})

    def run():
        out = pool.session.run_prepared(prepared, spec, config, forward_only=False, tags=["a", "b", "a", "b"])
        grads = {n: {k: p.grad.clone() for k, p in pool.slot_parameters(n).items() if p.grad is not None}
                 for n in pool.slots}
        for n in pool.slots:
            for p in pool.slot_parameters(n).values():
                p.grad = None
        return [out], grads

    (c_out, c_grads), (s_out, s_grads) = _twice(pool, run, attr="peft")
    _assert_same_units(c_out, s_out)
    for n in pool.slots:
        assert c_grads[n] and c_grads[n].keys() == s_grads[n].keys()
        assert all(torch.equal(c_grads[n][k], s_grads[n][k]) for k in c_grads[n])


# ---------------------------------------------------------------------- the trainer
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["grpo", "adaptive-reuse"])
def test_a_whole_trainer_step_with_the_hf_rollout_backend(tmp_path, tiny_model_path, tiny_tokenizer, variant):
    """Trainer.step: rollout (transformers sampling on the host: the actor's shared module),
    scoring, advantages, the update(s) and the sync probe, with the actor on the device; equal to
    the same step on the CPU (same seeds), metric by metric. adaptive-reuse: two optimizer steps
    per rollout, so the second one's old policy comes from the adaptive probe."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from _real_engine import FakeSource, build_engine, make_cfg

    from dsrl.rollout.hf_worker import HFWorker
    from dsrl.trainer import Trainer
    from dsrl.validation.reuse import decide_reuse

    extra = ({"reuse_logprobs": "adaptive", "num_steps_per_rollout": 2, "global_batch_size": 3}
             if variant == "adaptive-reuse" else {})
    cfg = make_cfg(tiny_model_path, groups=2, group_size=3, micro_batch_size=3, **extra)
    cfg.rollout = dataclasses.replace(cfg.rollout, sync_probe=True, max_new_tokens=6)
    rows = []
    for on_device in (False, True):
        actor = build_engine(tiny_model_path, micro_batch_size=3)
        worker = HFWorker(str(tiny_model_path), module=actor.module, seed=7, tokenizer=tiny_tokenizer)
        trainer = Trainer(cfg, actor=actor, ref=None, worker=worker, tokenizer=tiny_tokenizer, source=FakeSource(),
                          verifier=lambda text, p: float(len(text) % 2),
                          prompt_ids_fn=lambda p: tiny_tokenizer.encode(p.messages[0]["content"],
                                                                        add_special_tokens=False),
                          decision=decide_reuse(cfg), run_dir=str(tmp_path / f"run{int(on_device)}"))
        torch.manual_seed(1)
        if on_device:
            with on_simulated_device(actor):
                rows.append(trainer.step(1))
        else:
            rows.append(trainer.step(1))
    cpu, sim = rows
    timing = {k for k in cpu if k.startswith("timing/") or k.startswith("perf/")}
    assert cpu.keys() == sim.keys()
    for k in sorted(set(cpu) - timing):
        assert cpu[k] == sim[k], (k, cpu[k], sim[k])
    assert cpu["train/grad_norm"] > 0 and "rollout/sync_logprob_diff" in cpu
    if variant == "adaptive-reuse":
        assert cpu["reuse/probe_tokens"] > 0


def test_copy_into_a_device_tensor_may_read_the_host_as_on_cuda():
    with simulated_accelerator():
        x = torch.zeros(3).to(SIM)
        x.copy_(torch.tensor([1.0, 2.0, 3.0]))
        assert is_sim(x) and x.tolist() == [1.0, 2.0, 3.0]
