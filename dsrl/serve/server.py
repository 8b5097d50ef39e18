"""Running the service: build it from the typed config (`build_service`), serve it with uvicorn,
in the foreground (`serve_forever`, used by ``python -m dsrl.serve``) or in a background thread
(`ServerThread`, used by tests and the benchmark)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from dsrl.serve.service import Service, ServiceOptions

log = logging.getLogger("dsrl.serve")


def untied_base_folder(model_path: str, out_dir: "str | os.PathLike[str]") -> str:
    """The folder the sampler's vLLM engine starts from: the base model itself when its head is
    untied, else a copy with the head written out (see dsrl.hf_folder)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    if not getattr(cfg, "tie_word_embeddings", False):
        return model_path
    from dsrl.hf_folder import WEIGHTS_FILE, write_hf_folder

    out = Path(out_dir)
    if (out / WEIGHTS_FILE).is_file():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {n: p.detach() for n, p in model.named_parameters()}
    write_hf_folder(out, state, model.config, untie=True, tokenizer=model_path, atomic=True)
    return str(out)


def build_service(opts: ServiceOptions) -> Service:
    """The service, with a vLLM sampler when ``opts.sampling`` (its engine starts here, in the
    calling thread: ~25 s on CPU)."""
    sampler = None
    if opts.sampling:
        from dsrl.serve.sampler import VllmSampler

        base = untied_base_folder(opts.model_path, Path(opts.checkpoint_dir) / "_sampler_base")
        sampler = VllmSampler(base, opts.model_path, **opts.sampler)
    return Service(opts, sampler=sampler)


def _uvicorn_server(service: Service, api_keys, host: str, port: int):
    import uvicorn

    from dsrl.serve.app import build_app

    app = build_app(service, api_keys)
    config = uvicorn.Config(app, host=host, port=int(port), log_level="warning", access_log=False,
                            timeout_keep_alive=75)
    return uvicorn.Server(config)


class ServerThread:
    """uvicorn in a daemon thread; ``url`` once started. ``stop()`` shuts down server and service."""

    def __init__(self, service: Service, api_keys, host: str = "127.0.0.1", port: Optional[int] = None):
        from dsrl.distributed.ports import free_port

        self.service = service
        self.host = host
        self.port = int(port or free_port())
        self._server = _uvicorn_server(service, api_keys, host, self.port)
        self._thread = threading.Thread(target=self._server.run, name="dsrl-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the Tinker service did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.service.close()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def serve_forever(service: Service, api_keys, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM; either way the service is closed (the sampler's vLLM engine
    processes stopped) before the process exits (SIGTERM: exit status 143).

    uvicorn shuts the HTTP side down on a signal, then raises the signal again under the handler
    that was there before it ran. SIGINT's default raises KeyboardInterrupt; SIGTERM's default ends
    the process on the spot, before `service.close()`: the vLLM engine outlived the server. So
    SIGTERM's handler here turns it into SystemExit."""
    server = _uvicorn_server(service, api_keys, host, port)
    log.info("serve: Tinker service for %r on http://%s:%d  (TINKER_BASE_URL=http://%s:%d)",
             service.opts.model_name, host, port, host, port)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        log.info("serve: stopped")
    except SystemExit as e:
        log.info("serve: stopped (exit status %s)", e.code)
        raise
    finally:
        service.close()
