"""The checks of a typed config (dsrl.config.schema) that need the components' registries and rules,
so they stand above the components and below main:

- validate (`validate`): every key's range, choice and plug-in name, reported together before
  anything heavy loads;
- reuse (`decide_reuse`, `ReuseDecision`, `check_reuse_invariants`): whether the standalone
  old-policy pass may be skipped, decided from the config, the model's config and its modules,
  and re-checked at run time."""
