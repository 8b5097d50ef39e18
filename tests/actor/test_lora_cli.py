"""`python -m dsrl.main actor.lora.rank=8` end to end on the tiny model with the default vLLM-CPU
worker: the Hydra entry, validation, the LoRA actor, the LoRA-enabled engine fed by the
adapter-only sync, two RL steps, a checkpoint and the final output. Checked: every sync sends
exactly the adapter (32768 parameters = 131072 bytes in float32, counted by hand below) and its
probe agrees with the trainer (< 1e-4); the adapter trains; the final folder is a merged HF model
that transformers loads, with the PEFT adapter beside it reproducing it on the base model."""
import os
from pathlib import Path

import pytest
import torch

from dsrl.testing import run_job

# Tiny Llama: hidden 128, 2 KV heads x head_dim 32 = 64, MLP 256, 2 layers; rank 8 on all seven projections.
# Per layer, A (8 x in) + B (out x 8): q 8*128+128*8, k and v 8*128+64*8 each, o 8*128+128*8,
# gate and up 8*128+256*8 each, down 8*256+128*8.
ADAPTER_PARAMS = 2 * (2048 + 1536 + 1536 + 2048 + 3072 + 3072 + 3072)


def length_reward(completion_text, prompt) -> float:
    """Rewards that differ within a group on a random model (non-zero advantages)."""
    return float(len(completion_text) % 3 == 0)


@pytest.mark.slow
def test_lora_job_runs_from_the_command_line(tmp_path, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    cmd = ["-m", "dsrl.main", "+exp=grpo_reuse", "actor.lora.rank=8", "actor.lora.alpha=16",
           "actor.lr=1e-2", "trainer.total_steps=2", f"model.path={tiny_model_path}", "model.dtype=float32",
           "rollout.dtype=float32", "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4",
           "algo.global_batch_size=8", "rollout.max_new_tokens=8", "reward.fn=test_lora_cli.length_reward",
           "algo.skip_zero_variance_groups=false", "trainer.eval_before=false", "trainer.eval_after=false",
           "trainer.save_every=2", "logger.plot=false", "logger.tensorboard=false", f"hydra.run.dir={run_dir}"]
    rows = run_job(cmd, run_dir, timeout=900,
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/sync_bytes"] == ADAPTER_PARAMS * 4
        assert 0.0 <= row.get("rollout/sync_logprob_diff", 0.0) < 1e-4, row  # probed: the first push (auto)
    assert "rollout/sync_logprob_diff" in rows[0], rows[0]
    assert any(row["train/grad_norm"] > 0 for row in rows if "train/grad_norm" in row), rows
    assert (run_dir / "checkpoints" / "step-000002" / "COMPLETE.json").exists()

    final = run_dir / "final_model"
    ids = torch.randint(10, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        untrained = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(final / "adapter")).eval()(input_ids=ids).logits
    assert float((got - untrained).abs().max()) > 1e-4  # the saved model is the trained one
    torch.testing.assert_close(got, adapted, rtol=0, atol=2e-5)
