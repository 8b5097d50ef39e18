"""The environments dsrl ships; importing this package registers them (dsrl.agent.env):
`calculator` (arithmetic/GSM8K questions with a calculator tool) and `guess_the_number`
(textarena's GuessTheNumber game, loaded offline without textarena's optional dependencies)."""
from dsrl.agent.envs import calculator, guess_the_number  # noqa: F401  (register on import)
