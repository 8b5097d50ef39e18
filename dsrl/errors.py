"""The errors that every layer raises, in one module with no dsrl imports, so that any layer can
raise them without importing the config or its checks."""


class ConfigError(ValueError):
    """A bad config value; the message names the key(s)."""


class ReuseInvariantError(RuntimeError):
    """Log-prob reuse was decided (dsrl.validation.reuse) but the data in hand breaks its exactness
    (a named runtime guard, not an `assert`, so that `python -O` keeps it)."""
