"""textarena's GuessTheNumber as a dsrl environment: the model guesses a hidden number in
[min_number, max_number] by writing it in square brackets ("[7]"); the game answers "higher" /
"lower". textarena's rewards: +1 for a correct guess; 0 when its `max_turns` guesses run out;
-1 after a second invalid move in a row (no "[n]", out of range, or repeated: the first one
only gets a warning). `instruction` is appended to the game's first message: with textarena's
prompt alone SmolLM2-135M never wrote a "[n]" guess (16 of 16 games lost by invalid moves).

textarena draws the hidden number with Python's global `random` BEFORE seeding it in reset;
this wrapper seeds the global generator with the episode seed around reset() and restores its
state afterwards, so an episode is reproducible from its seed and nothing else is disturbed."""
from __future__ import annotations

import random
from typing import Any, Optional

from dsrl.agent.env import StepResult, register_env
from dsrl.agent.envs.textarena_loader import load_game


@register_env("guess_the_number")
class GuessTheNumber:
    def __init__(self, min_number: int = 1, max_number: int = 20, max_turns: int = 10, player_id: int = 0,
                 instruction: str = "\nReply with only your guess in square brackets, for example [10]."):
        if not min_number < max_number:
            raise ValueError(f"rollout.env_kwargs: min_number={min_number} must be < max_number={max_number}")
        game = load_game("GuessTheNumber", "GuessTheNumberEnv")
        self.game = game(min_number=min_number, max_number=max_number, max_turns=max_turns)
        self.player_id = int(player_id)
        self.instruction = instruction

    def _observation(self) -> str:
        """New game messages for the player, without the echo of its own move."""
        _, msgs = self.game.get_observation()
        return "\n".join(str(text) for sender, text in msgs if sender != self.player_id)

    def reset(self, prompt: Any = None, seed: Optional[int] = None) -> str:
        state = random.getstate()
        try:
            if seed is not None:
                random.seed(int(seed))
            self.game.reset(num_players=1, seed=None if seed is None else int(seed))
        finally:
            random.setstate(state)
        return self._observation() + self.instruction

    @property
    def target(self) -> int:
        return int(self.game.game_number)

    def step(self, action: str) -> StepResult:
        state = random.getstate()
        try:
            done, info = self.game.step(action)
        finally:
            random.setstate(state)
        info = dict(info or {})
        if done:
            rewards = self.game.close() or {}
            return StepResult(observation="", reward=float(rewards.get(self.player_id, 0.0)), done=True, info=info)
        return StepResult(observation=self._observation() or "Enter your guess.", info=info)
