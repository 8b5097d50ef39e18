"""Shared by the before/after evaluation scripts (eval_gsm8k.py, eval_reasoning_gym.py): a preset's
config as a run would resolve it, and one subprocess per model folder (one vLLM engine each, freed on
exit) whose `RESULT {json}` line is returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def preset_config(exp: str, overrides):
    """The typed config of `+exp=<exp>` plus `overrides`, `auto` settings resolved for this machine."""
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs, to_config
    from dsrl.main import _resolve_hardware

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        node = compose(config_name="config", overrides=[f"+exp={exp}", *overrides])
    cfg = to_config(node)
    _resolve_hardware(cfg, node)
    return cfg


def result_of_model(script: str, model: str, args) -> Optional[dict]:
    """Run `script --one MODEL ARGS` and return its RESULT dict (None, with the reason printed, on failure)."""
    r = subprocess.run([sys.executable, os.path.abspath(script), "--one", model, *args], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        print(f"{model}: failed (rc {r.returncode}): {(r.stderr or '').strip().splitlines()[-3:]}", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def engine_and_prompts(path: str, cfg, num: int):
    """(vllm.LLM on model folder `path` with the preset's dtype and context, the preset's first `num`
    held-out prompts, their token ids as vLLM prompts)."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import build_source
    from dsrl.rollout.vllm_engine import engine_env
    from dsrl.setup_assets import default_cache_dir, resolve_model_path

    os.environ.update(engine_env(cfg.rollout.kv_cache_gib, 0, 1, multiprocess=True))  # vllm.LLM here, its core apart
    path = resolve_model_path(path, str(default_cache_dir()))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = build_source(cfg.data).eval_set(num)
    ids = [{"prompt_token_ids": apply_chat_template(tok, p, cfg.data.system_prompt, cfg.data.chat_template)}
           for p in prompts]
    llm = LLM(model=path, tokenizer=path, dtype=cfg.rollout.dtype, max_model_len=cfg.rollout.max_model_len,
              enforce_eager=True, seed=cfg.rollout.seed)
    return llm, prompts, ids
