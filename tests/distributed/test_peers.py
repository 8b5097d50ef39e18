"""dsrl.distributed.peers: a failed collective's error becomes one line naming the lost rank and its
host (the two-host run is in tests/multinode)."""
from dsrl.distributed import peers

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
              "[10.77.0.2]:54973. This is typically caused by a remote worker crashing.")


def test_the_address_in_the_error_names_the_lost_ranks(monkeypatch):
    monkeypatch.setattr(peers, "_table", [(0, "a", "10.77.0.1"), (1, "b", "10.77.0.2"), (2, "b", "10.77.0.2"),
                                          (3, "c", "10.77.0.3")])
    monkeypatch.setattr(peers, "global_rank", lambda: 0)  # not RANK: an earlier test may have initialised torch.distributed
    msg = peers.lost_rank_message(RuntimeError(GLOO_RESET))
    assert msg.startswith("lost rank 1 on host b (10.77.0.2), rank 2 on host b (10.77.0.2): a collective on rank 0 "
                          "on host a (10.77.0.1) failed: [/__w/")


def test_a_timeout_names_every_other_rank_as_a_suspect_and_other_errors_pass(monkeypatch):
    monkeypatch.setattr(peers, "_table", [(0, "a", "10.77.0.1"), (1, "b", "10.77.0.2")])
    monkeypatch.setattr(peers, "global_rank", lambda: 1)
    msg = peers.lost_rank_message(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                               "60000ms for recv operation to complete"))
    assert msg.startswith("a collective on rank 1 on host b (10.77.0.2) failed waiting for another rank (one of: "
                          "rank 0 on host a (10.77.0.1)): [gloo/")
    assert peers.lost_rank_message(RuntimeError("CUDA out of memory")) is None
    assert peers.lost_rank_message(ValueError(GLOO_RESET)) is None
    monkeypatch.setattr(peers, "_table", [])  # a single process: never recorded
    assert peers.lost_rank_message(RuntimeError(GLOO_RESET)) is None


def _raised_in(filename: str, message: str) -> RuntimeError:
    """`RuntimeError(message)` raised by code whose frame reads `filename`."""
    try:
        exec(compile(f"raise RuntimeError({message!r})", filename, "exec"), {})
    except RuntimeError as e:
        return e
    raise AssertionError("not raised")


def test_only_an_error_out_of_torch_distributed_is_a_lost_rank(monkeypatch):
    """A Ray engine's death read 'RpcError: recvmsg:Connection reset by peer' (a clean-clone run of
    the two-host Ray test): taken for a failed collective, both ranks printed 'a collective ... failed
    waiting for another rank' instead of the RolloutEngineError naming the engine."""
    import os

    monkeypatch.setattr(peers, "_table", [(0, "a", "10.77.0.1"), (1, "b", "10.77.0.2")])
    monkeypatch.setattr(peers, "global_rank", lambda: 0)
    ray_text = ("vLLM engine 1 (Ray actor 'engine-1'): died during generate: ActorUnavailableError: RpcError: "
                "recvmsg:Connection reset by peer rpc_code: 14")
    assert peers.lost_rank_message(_raised_in(os.path.join("x", "dsrl", "rollout", "ray_engines.py"), ray_text)) is None
    gloo = _raised_in(os.path.join("x", "torch", "distributed", "distributed_c10d.py"), GLOO_RESET)
    assert peers.lost_rank_message(gloo).startswith("lost rank 1 on host b (10.77.0.2): a collective on rank 0")
    try:  # a dsrl error raised from the collective's: still the lost rank
        raise RuntimeError("broadcast failed: " + GLOO_RESET) from gloo
    except RuntimeError as wrapped:
        assert peers.lost_rank_message(wrapped).startswith("lost rank 1 on host b (10.77.0.2)")
