"""Hydra entry of the Tinker service: compose -> validate (before anything heavy) -> build -> serve.

    python -m dsrl.serve +exp=tinker_service [serve.port=8001 serve.api_keys='[tml-secret-key]' ...]
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from dsrl.config.schema import register_configs

log = logging.getLogger("dsrl")
register_configs()


def prepare(cfg_node: DictConfig, run_dir: str):
    """Typed config, validated (general rules + serve.*) and hardware-resolved; the model folder.
    Raises ConfigError listing every problem; nothing heavy has loaded by then."""
    from dsrl import hardware
    from dsrl.config.schema import to_config
    from dsrl.errors import ConfigError
    from dsrl.serve.config import serve_errors
    from dsrl.setup_assets import default_cache_dir, resolve_model_path, use_op_cache
    from dsrl.validation.validate import validate

    cfg = to_config(cfg_node)
    validate(cfg)
    errors = serve_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    machine = hardware.probe(local_ranks=1)
    decisions = hardware.decide(cfg, machine)
    hardware.apply(cfg, decisions)
    hardware.record_resolved(cfg_node, decisions)
    log.info(hardware.describe(machine))
    for d in decisions:
        (log.warning if d.warning else log.info)(d.line())
    cache = str(default_cache_dir())
    use_op_cache(cache)
    if not machine.cuda:  # DeepSpeed picks CUDA itself on a GPU machine: the service trains there
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        model_path = resolve_model_path(cfg.model.path, cache)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if cfg.serve.sampling:
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        if limit and cfg.rollout.max_model_len > limit:
            raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                              f"max_position_embeddings={limit} ({model_path}); lower it")
    OmegaConf.save(cfg_node, os.path.join(run_dir, "config.yaml"), resolve=True)
    return cfg, model_path


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg_node: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dsrl.errors import ConfigError
    from dsrl.tracking.console import adopt_library_loggers, setup_console

    run_dir = HydraConfig.get().runtime.output_dir
    setup_console(run_dir, verbose=bool(OmegaConf.select(cfg_node, "logger.verbose", default=False)))
    try:
        cfg, model_path = prepare(cfg_node, run_dir)
    except ConfigError as e:
        print(f"dsrl: {e}", file=sys.stderr)
        sys.exit(2)
    from dsrl.heap import imports_uncollected

    with imports_uncollected():  # the collector skips the imported objects from then on (dsrl/heap.py)
        import deepspeed  # noqa: F401 - the engines' imports, here to be frozen with the rest
        import torch
        import transformers  # noqa: F401

        from dsrl.distributed.ports import free_port
        from dsrl.distributed.reaper import Reaper
        from dsrl.serve.config import options_from_config
        from dsrl.serve.server import build_service, serve_forever

    adopt_library_loggers()
    torch.set_num_threads(cfg.actor.num_threads)
    opts = options_from_config(cfg, model_path, run_dir)
    reaper = Reaper.start()  # a SIGKILLed server's engine processes (the sampler's vLLM) are stopped too
    try:
        service = build_service(opts)
        port = cfg.serve.port or free_port()
        serve_forever(service, cfg.serve.api_keys, cfg.serve.host, port)
    finally:
        reaper.close()


if __name__ == "__main__":
    main()
