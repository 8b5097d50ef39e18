"""The stages of one RL step, each a module with one job and its own metrics; dsrl.trainer calls
them top to bottom:

- rollout (`RolloutStage`): draw prompts, generate, verify; dynamic rounds, episodes, the
  background rollout of the next step (overlap), fault counts;
- scoring (`ScoringPasses`): the forward-only passes that are needed (old policy unless reused,
  the adaptive probe, reference, teacher, the critic's values) and the advantages;
- policy update (`PolicyUpdate`): one optimizer step of the actor from the step's plan;
- critic update (`CriticUpdate`): gae's value model, its values and its optimizer step;
- evaluation (`evaluate`): greedy accuracy on the held-out prompts;
- loop state (`LoopState`): everything a checkpoint must carry besides the engines' own state."""
