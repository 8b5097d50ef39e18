"""``python -m dsrl.serve``: bad serve.* settings stop it before anything loads, each named; a real
server process with its sampler answers the SDK (LoRA client: forward_backward, optim_step,
save_state) and, stopped by SIGTERM, leaves none of its vLLM engine processes behind; nor does one
stopped by SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from serve_helpers import SAMPLER, start_server_process

from dsrl.testing import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_errors_name_every_key(tmp_path):
    cmd = [sys.executable, "-m", "dsrl.serve", "+exp=tinker_service", "model.path=tiny", "serve.api_keys=[secret]",
           "serve.long_poll_seconds=90", "+serve.custom_losses.sq=nowhere_pkg.fn", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "serve.api_keys[0] must be a string starting with 'tml-'" in out.stderr
    assert "serve.long_poll_seconds=90" in out.stderr
    assert "serve.custom_losses.sq: cannot load 'nowhere_pkg.fn'" in out.stderr


@pytest.mark.slow
def test_server_process_answers_the_sdk_and_sigterm_leaves_no_engine_process(tmp_path, tiny_model_path):
    """A server with its vLLM sampler answers the SDK (LoRA client); then `kill` (SIGTERM) stops it
    after closing the service, exit status 143, and none of the sampler's engine processes outlives
    it (before, uvicorn re-raised SIGTERM under the default handler and they did)."""
    import psutil

    proc, url = start_server_process(tmp_path, tiny_model_path, "tml-entry-test", *SAMPLER, sampling=True)
    try:
        import tinker
        from tinker import types

        sc = tinker.ServiceClient(base_url=url, api_key="tml-entry-test")
        tc = sc.create_lora_training_client("tiny", rank=4, seed=0).result()
        ids = tc.get_tokenizer().encode("2+2=4")
        d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        first = tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # a small step goes downhill
        assert tc.forward([d], "cross_entropy").result().metrics["loss:sum"] < first
        path = tc.save_state("end").result().path
        assert os.path.isfile(os.path.join(tmp_path, "checkpoints", path[len("tinker://"):], "tinker.json"))
        sc.close("success").result()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any(c.name().startswith("VLLM") for c in children), [c.name() for c in children]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"outlived the server: {[(p.pid, p.name()) for p in alive]}"
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.parametrize("host,refused", [("0.0.0.0", True), ("10.1.2.3", True), ("myhost", True),
                                          ("127.0.0.1", False), ("::1", False), ("localhost", False)])
def test_the_published_key_is_refused_off_loopback(host, refused):
    """serve.api_keys=[tml-dsrl-local] (the docs' key) on an interface other machines reach:
    refused before anything loads, naming serve.api_keys; with your own key it is fine."""
    import dataclasses

    from dsrl.config.schema import Config
    from dsrl.serve.config import serve_errors

    cfg = Config()
    cfg.serve = dataclasses.replace(cfg.serve, host=host, api_keys=["tml-dsrl-local"])
    errors = [e for e in serve_errors(cfg) if "published default key" in e]
    assert bool(errors) is refused
    if refused:
        assert errors[0].startswith("serve.api_keys holds the published default key 'tml-dsrl-local' while "
                                    f"serve.host={host!r}")
    cfg.serve = dataclasses.replace(cfg.serve, api_keys=["tml-my-own-secret"])
    assert not [e for e in serve_errors(cfg) if "published default key" in e]



@pytest.mark.slow
def test_a_sigkilled_server_leaves_no_engine_process(tmp_path, tiny_model_path):
    """SIGKILL: the server's watchdog (dsrl.distributed.reaper) stops its vLLM engine processes
    (SIGTERM: test_server_process_answers_the_sdk_and_sigterm_leaves_no_engine_process)."""
    import psutil

    proc, _ = start_server_process(tmp_path, tiny_model_path, "tml-entry-test", *SAMPLER, sampling=True)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any(c.name().startswith("VLLM") for c in children), [c.name() for c in children]
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"outlived the server: {[(p.pid, p.name()) for p in alive]}"
