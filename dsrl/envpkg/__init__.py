"""Programs run with an environment package's own venv, not dsrl's (verifiers_episode.py: verifiers 0.4)."""
