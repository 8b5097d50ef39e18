"""A Tinker-compatible training service: the official ``tinker`` SDK (0.38) trains and samples
models served by dsrl.

    python -m dsrl.serve +exp=tinker_service            # then, in the client's shell:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-dsrl-local python my_sl_loop.py

Modules: `app` (HTTP routes, API keys), `service` (sessions, clients, futures, checkpoints),
`wire` (the protobuf half of the wire), `sequencer` (per-client seq_id order, retries),
`executor` (the compute thread, merged batches), `full_model` (DeepSpeed full-parameter
clients), `lora` (multi-LoRA slots, merged optimizer step), `objectives` (loss_fn -> loss hub),
`store` (tinker:// checkpoints), `sampler` (vLLM sampling), `server` (uvicorn), `config`.
"""
