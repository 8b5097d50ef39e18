"""The console shows dsrl's lines and the libraries' warnings; everything lands in run.log; vLLM's
engine processes log to vllm.log; one progress bar for generation."""
import io
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

from dsrl.testing import subprocess_env
from dsrl.tracking import console as console_mod
from dsrl.tracking.console import adopt_library_loggers, prints_to_log, setup_console


@pytest.fixture
def fresh_logging(monkeypatch):
    """setup_console changes process-wide state: root handlers, env, warning capture. Undo it."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    names = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", "HF_HUB_DISABLE_PROGRESS_BARS",
             "PYTHONWARNINGS", "RANK")
    # monkeypatch.delenv of an unset name records nothing, so what setup_console sets would outlive
    # the test (a later vLLM engine then reads a logging config from a deleted tmp_path).
    env_before = {name: os.environ.get(name) for name in names}
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(console_mod, "_vllm_config_set", None)
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])
    logging.captureWarnings(False)
    for name, value in env_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _setup(tmp_path, verbose=False):
    out = io.StringIO()
    paths = setup_console(tmp_path, verbose=verbose, stream=out)
    return out, paths


def _flush():
    for h in logging.getLogger().handlers:
        h.flush()


def test_library_info_goes_to_run_log_only(tmp_path, fresh_logging):
    out, paths = _setup(tmp_path)
    logging.getLogger("somelib.core").info("library chatter 123")
    logging.getLogger("dsrl").info("step 1 | reward 0.5")
    logging.getLogger("dsrl.trainer").info("a dsrl child logger line")
    logging.getLogger("somelib.core").warning("library warning 456")
    _flush()
    shown = out.getvalue()
    logged = paths["run_log"].read_text()
    assert "library chatter 123" not in shown and "library chatter 123" in logged
    assert "step 1 | reward 0.5" in shown and "step 1 | reward 0.5" in logged
    assert "a dsrl child logger line" in shown
    assert "library warning 456" in shown and "library warning 456" in logged
    assert "WARNING [somelib.core] library warning 456" in shown
    assert paths["run_log"] == tmp_path / "run.log"


def test_verbose_shows_library_info(tmp_path, fresh_logging):
    out, paths = _setup(tmp_path, verbose=True)
    logging.getLogger("somelib.core").info("library chatter 123")
    _flush()
    assert "library chatter 123" in out.getvalue()
    assert "library chatter 123" in paths["run_log"].read_text()


def test_repeated_library_warning_shown_once_but_logged_every_time(tmp_path, fresh_logging):
    out, paths = _setup(tmp_path)
    lib = logging.getLogger("somelib.loader")
    for name in ("w1", "w2", "w3"):
        lib.warning("Attempted to load weight %s with dtype float32", name)  # one call site
    lib.warning("another warning")
    lib.error("an error")
    lib.error("an error")  # errors are never deduplicated
    _flush()
    shown = out.getvalue()
    assert shown.count("Attempted to load weight") == 1 and "w1" in shown
    assert paths["run_log"].read_text().count("Attempted to load weight") == 3
    assert "another warning" in shown and shown.count("an error") == 2


@pytest.mark.parametrize("verbose", [False, True])
def test_known_noise_stays_in_the_log(tmp_path, fresh_logging, verbose):
    out, paths = _setup(tmp_path, verbose=verbose)
    lib = logging.getLogger("vllm_like.serial_utils")
    lib.warning("Allowing insecure serialization using pickle due to VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    lib.error("Allowing insecure serialization failed badly")  # an error is never noise
    _flush()
    shown = out.getvalue()
    assert ("using pickle" in shown) == verbose
    assert "failed badly" in shown
    assert "using pickle" in paths["run_log"].read_text()


def test_python_warnings_are_routed(tmp_path, fresh_logging):
    out, paths = _setup(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a user warning 789", UserWarning)
    _flush()
    assert "a user warning 789" in out.getvalue() and "a user warning 789" in paths["run_log"].read_text()


def test_library_with_own_handler_is_adopted(tmp_path, fresh_logging):
    lib = logging.getLogger("printylib")  # like DeepSpeed: its own stdout handler, no propagation
    own = logging.StreamHandler(sys.stdout)
    lib.addHandler(own)
    lib.propagate = False
    lib.setLevel(logging.INFO)
    try:
        out, paths = _setup(tmp_path)  # setup_console adopts the loggers that exist now
        assert own not in lib.handlers and lib.propagate
        lib.info("op loaded")
        lib.warning("op slow")
        _flush()
        assert "op loaded" not in out.getvalue() and "op slow" in out.getvalue()
        assert "op loaded" in paths["run_log"].read_text()
        assert adopt_library_loggers() == 0  # idempotent
    finally:
        lib.handlers.clear()
        lib.propagate = True


def test_prints_go_to_run_log(tmp_path, fresh_logging, capsys):
    out, paths = _setup(tmp_path)
    with prints_to_log("DeepSpeed"):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("no newline at the end", end="")
    _flush()
    assert capsys.readouterr().out == ""
    assert "built successfully" not in out.getvalue()
    logged = paths["run_log"].read_text()
    assert "DeepSpeed: DeepSpeed deepspeed.ops.comm" in logged and "no newline at the end" in logged


def test_setup_is_idempotent_and_replaces_hydra_handlers(tmp_path, fresh_logging):
    hydra_like = logging.StreamHandler(io.StringIO())
    hydra_file = logging.FileHandler(tmp_path / "main.log")  # Hydra's <job>.log, still empty
    kept = tmp_path / "kept.log"
    kept_file = logging.FileHandler(kept)
    kept_file.stream.write("user data\n")
    for h in (hydra_like, hydra_file, kept_file):
        logging.getLogger().addHandler(h)
    _setup(tmp_path)
    out, paths = _setup(tmp_path)
    root = logging.getLogger()
    assert hydra_like not in root.handlers and len(root.handlers) == 2
    assert not (tmp_path / "main.log").exists() and kept.read_text() == "user data\n"
    assert paths["run_log"].exists()
    logging.getLogger("dsrl").info("once")
    assert out.getvalue().count("once") == 1


def test_only_empty_regular_log_files_are_removed(tmp_path, fresh_logging):
    """A handler writing to a device (/dev/null, here a FIFO standing in for one: size 0, not a
    regular file) keeps its target: removing it once deleted this machine's /dev/null."""
    fifo = tmp_path / "device-like"
    os.mkfifo(fifo)
    logging.getLogger().addHandler(logging.FileHandler(fifo, delay=True))  # delay: never opened
    _setup(tmp_path)
    assert fifo.exists() and not fifo.is_file()


def test_other_ranks_write_their_own_files(tmp_path, fresh_logging, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    _, paths = _setup(tmp_path)
    assert paths["run_log"].name == "run.rank1.log" and paths["vllm_log"].name == "vllm.rank1.log"


def test_user_vllm_logging_config_is_kept(tmp_path, fresh_logging, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/somewhere/mine.json")
    _setup(tmp_path)
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == "/somewhere/mine.json"


@pytest.mark.parametrize("verbose", [False, True])
def test_vllm_processes_log_to_vllm_log(tmp_path, fresh_logging, verbose):
    """A fresh process (like vLLM's engine core) configured by vLLM itself from the environment
    setup_console leaves: INFO to vllm.log only, warnings also to its stderr."""
    _, paths = _setup(tmp_path, verbose=verbose)
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(paths["vllm_config"])
    json.loads(paths["vllm_config"].read_text())
    code = ("from vllm.logger import _configure_vllm_root_logger, init_logger\n"
            "_configure_vllm_root_logger()\n"
            "log = init_logger('vllm.v1.engine.core')\n"
            "log.info('engine info line')\n"
            "for _ in range(3): log.warning('engine warning line')\n")
    env = subprocess_env(VLLM_LOGGING_CONFIG_PATH=os.environ["VLLM_LOGGING_CONFIG_PATH"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    shown = r.stdout + r.stderr
    logged = paths["vllm_log"].read_text()
    assert logged.count("engine info line") == 1 and logged.count("engine warning line") == 3
    assert ("engine info line" in shown) == verbose
    assert shown.count("engine warning line") == (3 if verbose else 1)


def test_generation_shows_one_dsrl_bar():
    """vLLM's use_tqdm factory: its rendering pass gets no bar, its processing pass dsrl's bar."""
    from dsrl.rollout.vllm_engine import _generation_bar

    prompts = [1, 2, 3]
    assert _generation_bar(prompts, desc="Rendering prompts") is prompts
    bar = _generation_bar(total=64, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed")
    try:
        assert bar.desc == "generate" and bar.total == 64 and not bar.leave
        bar.postfix = "est. speed input: 1.00 toks/s"  # what vLLM does with it
        bar.update(8)
        assert bar.n == 8 and bar.format_dict["elapsed"] >= 0
    finally:
        bar.close()


def test_a_start_up_failure_is_one_line_naming_cause_and_keys_with_the_traceback_in_run_log(tmp_path, fresh_logging):
    """dsrl.main._starting: a Ray / DeepSpeed / vLLM start-up error becomes one StartupError line
    (printed as `dsrl: ...` by main) naming the cause and the keys to look at; the traceback goes to
    run.log and not to the console. Config errors pass through unchanged."""
    from dsrl.errors import ConfigError
    from dsrl.main import StartupError, _starting

    out, paths = _setup(tmp_path)
    with pytest.raises(StartupError) as err:
        with _starting("the vLLM rollout engine", "rollout.kv_cache_gib, rollout.max_model_len"):
            raise MemoryError("cannot allocate 96 GiB for the KV cache\nlong engine detail")
    assert str(err.value) == ("the vLLM rollout engine failed to start: MemoryError: cannot allocate 96 GiB for the "
                              "KV cache (look at rollout.kv_cache_gib, rollout.max_model_len; the traceback is in "
                              "run.log)")
    _flush()
    logged = paths["run_log"].read_text()
    assert "Traceback" in logged and "long engine detail" in logged
    assert "Traceback" not in out.getvalue() and "long engine detail" not in out.getvalue()
    with pytest.raises(ConfigError, match="bad key"):
        with _starting("x", "y"):
            raise ConfigError("bad key")
