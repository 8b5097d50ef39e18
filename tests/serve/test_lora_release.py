"""Releasing LoRA clients of the service's pool (dsrl.serve.lora) never freezes or detaches
another: PEFT, when the active adapter is deleted, activates another and sets requires_grad=False
on the rest. Four clients; the first and the third are released (in either order) between
training requests; the others keep training, and each one's weights equal a replay of its own
requests on a pool that holds it alone."""
import itertools

import pytest
import torch

from dsrl.actor.work_units import AdamParams
from dsrl.loss import tinker
from dsrl.loss.registry import get_objective
from dsrl.serve.lora import LoraPool, LoraSpec

pytestmark = pytest.mark.slow  # a few pools of the tiny model

SPEC = get_objective(tinker.tinker_objective_name("cross_entropy"))
CONFIG = tinker.resolve_config("cross_entropy", {})
NAMES = ("c0", "c1", "c2", "c3")


def _data(seed: int, n: int = 2) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = torch.randint(10, 1000, (7,), generator=g).tolist()
        out.append({"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:],
                                                                   "weights": [1.0] * 6}})
    return out


def _pool(path, names) -> LoraPool:
    pool = LoraPool(str(path), dtype=torch.float32, attn_implementation="eager", micro_batch_size=2, pad_id=0)
    for name in names:
        pool.add_slot(name, LoraSpec(rank=4, alpha=8.0, seed=NAMES.index(name)))
    return pool


def _train(pool, name, rnd):
    """One request of client `name` (its own datums for round `rnd`), then its optimizer step."""
    data = _data(100 * NAMES.index(name) + rnd)
    pool.session.run_prepared(pool.session.validate(data, "cross_entropy"), SPEC, CONFIG, forward_only=False,
                              tags=[name] * len(data))
    return pool.step({name: AdamParams(learning_rate=1e-2)})[name]["grad_norm:mean"]


def _weights(pool, name):
    return {k: p.detach().clone() for k, p in pool.slot_parameters(name).items()}


@pytest.mark.parametrize("order", list(itertools.permutations(("c0", "c2"))), ids=lambda o: "-".join(o))
def test_released_clients_leave_the_others_training_as_if_alone(tiny_model_path, order):
    pool = _pool(tiny_model_path, NAMES)
    for name in NAMES:
        assert _train(pool, name, 0) > 0
    pool.remove_slot(order[0])
    for name in ("c1", "c3", order[1]):
        assert _train(pool, name, 1) > 0, name  # a frozen adapter would have no gradient
    pool.remove_slot(order[1])
    for name in ("c1", "c3"):
        assert all(p.requires_grad for p in pool.slot_parameters(name).values())
        assert _train(pool, name, 2) > 0, name
    for name in ("c1", "c3"):  # the replay: this client's requests on a pool that holds it alone
        alone = _pool(tiny_model_path, [name])
        for rnd in range(3):
            _train(alone, name, rnd)
        got, want = _weights(pool, name), _weights(alone, name)
        assert got.keys() == want.keys()
        for k in got:  # same rows, same shapes and kernels: the other adapters add nothing to them
            assert torch.equal(got[k], want[k]), (name, k)
