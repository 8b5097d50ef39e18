"""A full-parameter training client: its own DeepSpeed `ActorEngine` on the base model, driven
through the in-process Tinker work units (`TrainingSession`). Training state is the engine's
DeepSpeed checkpoint (`ActorEngine.save_checkpoint`: weights and optimizer, any ZeRO stage)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from dsrl.actor.work_units import AdamParams, TrainingSession
from dsrl.hf_folder import write_hf_folder


class FullModel:
    is_lora = False
    lora_rank = 0

    def __init__(self, model_id: str, engine, *, micro_batch_size: int, pad_id: int):
        self.model_id = model_id
        self.engine = engine
        self.session = TrainingSession(engine, micro_batch_size, pad_id=pad_id)
        self.group_key = ("full", model_id)  # only this client's own consecutive chunks share a forward
        self.tag = None  # no per-row adapter
        self.lora_config: Optional[dict] = None

    @property
    def hf_config(self):
        return self.engine.hf_config

    def optim_step(self, params: AdamParams) -> Dict[str, float]:
        return self.session.optim_step(params).metrics

    def gradient_snapshot(self):
        return self.engine.gradient_snapshot()

    def restore_gradients(self, snapshot) -> None:
        self.engine.restore_gradients(snapshot)

    def save_state(self, folder: Path, *, optimizer: bool = True) -> None:
        """The engine's DeepSpeed checkpoint (weights + optimizer state of every ZeRO partition)."""
        self.engine.save_checkpoint(str(folder))

    def load_state(self, folder: Path, *, optimizer: bool) -> None:
        """Weights and (``optimizer``) the AdamW moments; without it the moments stay as they are
        (fresh for a new client)."""
        if optimizer:
            self.engine.load_checkpoint(str(folder))
            return
        # Weights only: DeepSpeed's module-only load from the one tag folder save_checkpoint wrote.
        tags = [p.name for p in Path(folder).iterdir() if p.is_dir()]
        if len(tags) != 1:
            raise FileNotFoundError(f"expected one DeepSpeed checkpoint folder in {folder}, found {tags}")
        path, _ = self.engine.engine.load_checkpoint(str(folder), tag=tags[0], load_module_only=True,
                                                     load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}/{tags[0]}")

    def export_sampler(self, folder: Path) -> None:
        """Full weights as an untied HF folder (dsrl.hf_folder) that the sampler reloads."""
        write_hf_folder(folder, self.engine.state_dict_for_export(), self.hf_config, untie=True)

    def release(self) -> None:
        self.engine = None
        self.session = None
        import gc

        gc.collect()


def build_full_model(model_id: str, model_path: str, *, zero_stage: int, dtype: str, attn_implementation: str,
                     micro_batch_size: int, pad_id: int, persistence_threshold: int) -> FullModel:
    from dsrl.actor.engine import ActorEngine

    engine = ActorEngine(model_path, zero_stage=zero_stage, dtype=dtype, attn_implementation=attn_implementation,
                         trainable=True, grad_clip=0.0, micro_batch_size=micro_batch_size,
                         persistence_threshold=persistence_threshold, role=f"serve:{model_id}")
    return FullModel(model_id, engine, micro_batch_size=micro_batch_size, pad_id=pad_id)
