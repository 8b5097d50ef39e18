"""The config's error type: a bad value, named by its key(s). Its own module so that any layer
can raise it without importing the config's logic."""


class ConfigError(ValueError):
    """A bad config value; the message names the key(s)."""
