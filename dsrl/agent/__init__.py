"""Multi-turn episodes: environments (env.py, envs/), a calculator tool (tools.py), token-exact
turn rendering (turns.py) and the batched episode runner (episodes.py). See README.md here for
how the trainer consumes the trajectories."""
