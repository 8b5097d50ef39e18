"""Prompt sources (name -> class registry), the Prompt record and chat-template encoding.

    src = build_source(cfg.data)            # or make_source("arith", digits=1)
    stream = PromptStream(src, seed=cfg.data.seed)
    batch = stream.next(8)                  # list[Prompt]
    held_out = src.eval_set(cfg.data.num_eval)
    ids = apply_chat_template(tokenizer, batch[0], cfg.data.system_prompt)

Importing this package registers the built-in sources (arith, gsm8k, reasoning_gym, verifiers, and the
user's files: jsonl, parquet, hf): they are imported here, so dsrl.data.registry itself imports no source module.
"""
from dsrl.data.types import Prompt, user_prompt
from dsrl.data.registry import (SOURCES, PromptSource, PromptStream, as_random, build_source,
                                make_source, register_source, source_class, source_names)
from dsrl.data.chat import (apply_chat_template, build_messages, encode_prompts,
                            plain_prompt_text, render_prompt)
from dsrl.data.errors import DataError
from dsrl.data.lengths import check_prompt_lengths, prompt_token_limit
# Built-in sources: each registers itself on import.
from dsrl.data.arith import ArithSource
from dsrl.data.gsm8k import GSM8KSource, load_gsm8k_split, parse_gsm8k_answer, textarena_data_dir
from dsrl.data.files import FileSource, HFDiskSource, JsonlSource, ParquetSource
from dsrl.data.reasoning_gym import ReasoningGymSource
from dsrl.data.verifiers_taskset import VerifiersTasksetSource

__all__ = [
    "Prompt", "user_prompt", "SOURCES", "PromptSource", "PromptStream", "as_random",
    "build_source", "make_source", "register_source", "source_class", "source_names", "apply_chat_template",
    "build_messages", "encode_prompts", "plain_prompt_text", "render_prompt", "ArithSource",
    "GSM8KSource", "load_gsm8k_split", "parse_gsm8k_answer", "textarena_data_dir", "DataError",
    "check_prompt_lengths", "prompt_token_limit", "FileSource", "HFDiskSource", "JsonlSource", "ParquetSource",
    "ReasoningGymSource", "VerifiersTasksetSource",
]
