"""The errors that every layer raises, in one module with no dsrl imports, so that any layer can
raise them without importing the config or its checks."""


class ConfigError(ValueError):
    """A bad config value; the message names the key(s)."""


class DatumError(ValueError):
    """A datum's contents leave the requested computation undefined (e.g. a loss that needs a
    token its mask does not mark): the caller's input to fix, not a failure of the code; the
    message names the datum and the field."""


class RunStopped(Exception):
    """A signal asked the run to stop; the state after `step` is checkpointed in `checkpoint`
    (raised by the trainer's loop; dsrl.main turns it into the exit status 128 + signal)."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint: {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class ReuseInvariantError(RuntimeError):
    """Log-prob reuse was decided (dsrl.validation.reuse) but the data in hand breaks its exactness
    (a named runtime guard, not an `assert`, so that `python -O` keeps it)."""
