"""The one place microbatches move to the engine's device (dsrl.actor.device)."""
import torch

from dsrl.actor.device import to_device, to_host


def _mb():
    return {"input_ids": torch.tensor([[1, 2, 3]]), "loss_mask": torch.ones(1, 2),
            "rollout_log_probs": [torch.tensor([-0.5, -1.0])], "sample_indices": [4], "loss_fn": "ppo",
            "datum_lengths": (3,), "nested": {"x": torch.zeros(2)}}


def test_cpu_move_keeps_tensors_and_leaves_the_rest():
    mb = _mb()
    out = to_device(mb, "cpu")
    assert out is not mb and out.keys() == mb.keys()
    assert out["input_ids"] is mb["input_ids"]  # already there: no copy
    assert out["rollout_log_probs"][0] is mb["rollout_log_probs"][0]
    assert out["nested"]["x"] is mb["nested"]["x"]
    assert out["sample_indices"] == [4] and out["loss_fn"] == "ppo" and out["datum_lengths"] == (3,)


def test_other_device_moves_every_tensor_and_only_pinned_ones_non_blocking(monkeypatch):
    """A move to another device calls Tensor.to(device, non_blocking=pinned) for every tensor,
    lists and dicts included; the `meta` device stands in for the accelerator here (only the
    call is checked, nothing runs on it)."""
    calls = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        calls.append((tuple(self.shape), args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.shape == (1, 3))
    out = to_device(_mb(), torch.device("meta"))
    assert {c[0] for c in calls} == {(1, 3), (1, 2), (2,)}
    assert len(calls) == 4
    for shape, args, kwargs in calls:
        assert args == (torch.device("meta"),)
        assert kwargs == {"non_blocking": shape == (1, 3)}
    assert out["input_ids"].device.type == "meta" and out["nested"]["x"].device.type == "meta"
    assert out["sample_indices"] == [4]


def test_to_host_returns_cpu_tensors_in_the_same_structure():
    lp = [torch.tensor([[-0.1, -0.2]]), torch.tensor([[-0.3]])]
    back = to_host(lp)
    assert isinstance(back, list) and all(torch.equal(a, b) for a, b in zip(back, lp))
    assert all(t.device.type == "cpu" for t in back)
