"""The rollout stage: this rank's prompts, generated and verified (single-turn completions,
multi-turn episodes, or a black-box agent's episodes through the OpenAI-compatible endpoint; with
dynamic sampling in rounds), the next step's rollout in a background thread under overlap
(algo.off_policy_steps=1), or asynchronous chunked generation with a staleness bound
(algo.async_schedule clock|deterministic: dsrl.rollout.async_buffer), and the rollout's metrics."""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import List

from dsrl.actor.batch import Sample
from dsrl.agent.rollout import generate_episode_samples, mean_episode_metrics
from dsrl.data.registry import source_metrics
from dsrl.data.types import Prompt
from dsrl.distributed.collectives import all_gather_objects, all_reduce_max, all_reduce_sum
from dsrl.distributed.ranks import global_rank, is_main_rank, world_size
from dsrl.rollout.dynamic import Rollout, collect_rollout
from dsrl.rollout.faults import FaultCounter, fault_metrics, pop_counts
from dsrl.rollout.async_buffer import AsyncGenerator, batch_samples
from dsrl.rollout.samples import generate_samples, score_calls
from dsrl.rollout.seeds import request_seeds
from dsrl.stages.state import LoopState
from dsrl.validation.validate import async_mode

log = logging.getLogger("dsrl")


def prompt_uid(prompt) -> str:
    """A training prompt's id in prompts.jsonl: Prompt.uid (the source's meta id, else its text)."""
    return prompt.uid if isinstance(prompt, Prompt) else str(prompt)


class RolloutStage:
    def __init__(self, cfg, *, worker, tokenizer, source, verifier, prompt_ids_fn, state: LoopState):
        self.cfg, self.worker, self.tokenizer, self.source = cfg, worker, tokenizer, source
        self.verifier, self.prompt_ids, self.state = verifier, prompt_ids_fn, state
        # What counts faults: the reward guard, and the worker when it is resilient (dsrl.rollout.factory's
        # workers are; a bare engine counts nothing).
        self.fault_counters = tuple(c for c in (worker, verifier) if isinstance(c, FaultCounter))
        # Divisibility by the world size is checked by dsrl.validation.validate before anything loads.
        self.prompts_per_rank = cfg.algo.rollout_batch_size // world_size()
        self.endpoint = None  # rollout.agent_endpoint: this rank's OpenAI-compatible server, started on first use
        self.mode = async_mode(cfg)  # sync | overlap | clock | deterministic
        # clock | deterministic: the generator thread over the loop state's buffer (started at the
        # first collect, after a restore has loaded the buffer).
        self.generator = None
        if state.async_buffer is not None:
            r = cfg.rollout
            self.generator = AsyncGenerator(
                state.async_buffer, worker=worker, draw_prompt=lambda: source.sample_train(1, state.prompt_rng)[0],
                prompt_ids_fn=prompt_ids_fn, score=self._score_group,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), prompt_rng=state.prompt_rng,
                deterministic=self.mode == "deterministic", chunk_tokens=r.chunk_tokens, max_tokens=r.max_new_tokens,
                temperature=r.temperature, top_p=r.top_p, seed=r.seed, rank=global_rank(),
                max_model_len=r.max_model_len)

    def _score_group(self, texts, prompt, group) -> list:
        return score_calls(self.verifier, [(t, prompt, f"group {group.index} (sample {j})")
                                           for j, t in enumerate(texts)])

    def agent_endpoint(self):
        """This rank's agent endpoint (dsrl.agent.endpoint), started on first use."""
        if self.endpoint is None:
            from dsrl.agent.endpoint.book import Limits
            from dsrl.agent.endpoint.server import AgentEndpoint, load_agent

            r = self.cfg.rollout
            limits = Limits(max_new_tokens=r.max_new_tokens, max_episode_tokens=r.max_episode_tokens,
                            max_model_len=r.max_model_len, max_calls=r.max_turns, temperature=r.temperature,
                            top_p=r.top_p)
            self.endpoint = AgentEndpoint(self.worker, self.tokenizer, limits=limits, agent=load_agent(r.agent),
                                          model_name=self.cfg.model.path, timeout_s=r.agent_timeout_s,
                                          max_request_bytes=r.agent_max_request_bytes, host=r.agent_host,
                                          failed_episodes=r.failed_episodes, tool_parser=r.tool_parser,
                                          tool_template=r.tool_template, stop_strings=r.backend != "hf").start()
        return self.endpoint

    def close(self) -> None:
        """Stop the asynchronous generator (not waiting for it) and the agent endpoint's server."""
        if self.generator is not None:
            self.generator.stop(wait=False)
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def finish(self) -> None:
        """No generation in flight from here on (before the greedy eval, at the end of a run)."""
        self.state.next_rollout.wait()
        if self.generator is not None:
            self.generator.stop()

    def restored(self, step: int) -> None:
        """After the loop state of the checkpoint of `step` is loaded: the asynchronous generator
        continues from the buffer's snapshot (its prompt stream position included); where the
        schedule cannot continue it exactly, one warning says why (AsyncBuffer.resume)."""
        if self.generator is not None:
            why = self.generator.buffer.resume(step, deterministic=self.mode == "deterministic")
            if why is not None and is_main_rank():
                log.warning("resuming the %s asynchronous schedule from the checkpoint of step %d: no longer bit "
                            "for bit the uninterrupted run: %s", self.mode, step, why)
            self.generator.restore_prompt_rng()

    def checkpoint_snapshot(self, step: int) -> None:
        """Before the checkpoint of `step` is written: the asynchronous buffer's snapshot
        (AsyncGenerator.checkpoint_snapshot)."""
        if self.generator is not None:
            held = self.generator.checkpoint_snapshot(step)
            log.debug("asynchronous buffer snapshot for the checkpoint of step %d: engine held %.4f s", step, held)

    def push(self, step: int, push_fn) -> dict:
        """Run the weight push `push_fn` (its metrics): asynchronous schedules load it between two
        generation chunks (deterministic: when the generator asks for step `step`'s weights)."""
        if self.generator is None:
            return push_fn()
        out = self.generator.push(step, push_fn)
        names = ("async/version_tokens", "async/version_chunks")
        out.update(zip(names, all_reduce_sum([out[n] for n in names])))
        for n in ("timing/push_wait", "timing/engine_pause"):
            out[n] = all_reduce_max(out[n])
        return out

    def collect(self, step: int) -> Rollout:
        """This rank's scored rollout of `step`: the one generated in the background during the
        previous step (algo.off_policy_steps=1; or restored from a checkpoint), step `step`'s batch
        of the asynchronous buffer (clock | deterministic), else generated now."""
        if self.generator is not None:
            return self._async_batch(step)
        held = self.state.next_rollout
        if held.holds(step):
            return held.take(step)
        return self._rollout(step, weights_step=self.state.weights_step,
                             show_progress=self.cfg.logger.progress and is_main_rank())

    def start_next(self, step: int) -> None:
        """Generate `step`'s rollout in a background thread with the weights the engine holds now
        (one step stale by the time it is trained). The main thread draws no prompts, pushes no
        weights and runs no eval until it is joined (dsrl.rollout.overlap)."""
        self.state.next_rollout.start(step, functools.partial(self._rollout, step, weights_step=self.state.weights_step,
                                                              show_progress=False))  # no bar beside the train bar

    def _rollout(self, step: int, *, weights_step: int, show_progress: bool) -> Rollout:
        """Draw prompts, generate and score them (with dynamic sampling: in rounds, dsrl.rollout.dynamic).
        Collective-free and touching only the worker, verifier and prompt stream: it may run in the
        background thread. Request seeds are unique per (step, round, global prompt index)."""
        cfg, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        first_prompt = global_rank() * self.prompts_per_rank
        episodes: List[tuple] = []  # rollout.env: (episodes, agent metrics) of each round
        uids: List[str] = []  # the uid of each prompt drawn, in draw order

        def generate_round(sampling_round: int, count: int) -> List[Sample]:
            prompts = self.source.sample_train(count, self.state.prompt_rng)
            uids.extend(prompt_uid(p) for p in prompts)
            if cfg.rollout.agent_endpoint:  # a black-box agent per episode, through the OpenAI-compatible endpoint
                seeds = request_seeds(cfg.rollout.seed, step, first_prompt, len(prompts), sampling_round)
                samples, agent_metrics = self.agent_endpoint().run_round(
                    prompts, n=a.n_samples_per_prompt, seeds=seeds, show_progress=show_progress)
                episodes.append((len(prompts) * a.n_samples_per_prompt, agent_metrics))
                return samples
            if cfg.rollout.env:  # multi-turn episodes: the environment writes the prompts and gives the rewards
                r = cfg.rollout
                seeds = request_seeds(r.seed, step, first_prompt, len(prompts), sampling_round)
                samples, agent_metrics = generate_episode_samples(
                    self.worker, self.tokenizer, prompts, env=r.env, env_kwargs=r.env_kwargs,
                    n=a.n_samples_per_prompt, max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens,
                    max_turn_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seeds=seeds,
                    max_context=r.max_model_len, show_progress=show_progress)
                episodes.append((len(samples), agent_metrics))
                return samples
            ids = [self.prompt_ids(p) for p in prompts]
            seeds = request_seeds(cfg.rollout.seed, step, first_prompt, len(ids), sampling_round)
            return generate_samples(self.worker, ids, prompts, self.verifier, n=a.n_samples_per_prompt,
                                    temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    max_tokens=cfg.rollout.max_new_tokens, show_progress=show_progress, seeds=seeds)

        out = collect_rollout(generate_round, share=self.prompts_per_rank, dynamic=a.dynamic_sampling,
                              max_rounds=a.max_sampling_rounds, first_draw=self.state.prompts_drawn)
        out.trained_prompts = [uids[d - self.state.prompts_drawn] for d in out.trained_draws]
        out.dropped_prompts = [uids[d - self.state.prompts_drawn] for d in out.dropped_draws]
        self.state.prompts_drawn += out.drawn
        out.weights_step, out.seconds = weights_step, time.perf_counter() - t0
        # This rank's fault counts, taken now: under overlap the next rollout starts before this
        # one's step logs its metrics.
        out.fault_counts = pop_counts(*self.fault_counters)
        out.source_metrics = source_metrics(self.source)
        out.source_metrics.update(mean_episode_metrics(episodes))  # agent/*: this rank's episodes, every round
        return out

    def _async_batch(self, step: int) -> Rollout:
        """Step `step`'s batch from the asynchronous buffer, as a Rollout, with its staleness counts."""
        t0 = time.perf_counter()
        gen = self.generator
        batch = gen.take(step)
        samples = batch_samples(batch)
        k = self.cfg.algo.off_policy_steps
        lags = [step - 1 - min(s.extra["versions"]) for s in samples]
        token_lags = [step - 1 - v for s in samples for v in s.extra["versions"]]
        counts = {"samples": len(samples), "staleness_sum": float(sum(lags)), "staleness_max": float(max(lags)),
                  "tokens": len(token_lags), "token_lag_sum": float(sum(token_lags)),
                  "stale_tokens": sum(1 for x in token_lags if x > 0),
                  "spanning": sum(1 for s in samples if len(set(s.extra["versions"])) > 1),
                  "trained_length_sum": sum(len(s.response_ids) for s in samples),
                  "dropped_groups": batch.dropped, "dropped_samples": batch.dropped_samples,
                  "dropped_length_sum": batch.dropped_length_sum, "engine_seconds": gen.generation_seconds}
        # staleness histogram (samples) and trained tokens per version lag; bucket k + 1: more than k
        by_lag, tokens_by_lag = Counter(min(x, k + 1) for x in lags), Counter(min(x, k + 1) for x in token_lags)
        for j in range(k + 2):
            counts[f"staleness_hist/{j}"], counts[f"tokens_lag/{j}"] = by_lag[j], tokens_by_lag[j]
        gen.generation_seconds = 0.0
        rewards = [s.reward for s in samples]
        out = Rollout(samples=samples, kept_groups=len(batch.groups), generated=len(samples) + batch.dropped_samples,
                      reward_sum=sum(rewards) + batch.dropped_reward_sum,
                      length_sum=sum(len(s.response_ids) for s in samples) + batch.dropped_length_sum,
                      weights_step=step - 1 - max(lags),  # the oldest token's version
                      seconds=time.perf_counter() - t0, async_counts=counts,
                      # a group's admission index is its draw number: one draw per admission
                      trained_draws=[g.index for g in batch.groups], dropped_draws=list(batch.dropped_ids),
                      trained_prompts=[prompt_uid(g.prompt) for g in batch.groups],
                      dropped_prompts=[prompt_uid(p) for p in batch.dropped_prompts])
        out.fault_counts = pop_counts(*self.fault_counters)
        out.source_metrics = source_metrics(self.source)
        return out

    def _async_metrics(self, rollout: Rollout) -> dict:
        """Staleness (per sample: the step before the trained one minus its oldest token's version;
        its max is the max over trained tokens), its histogram, trained tokens per version lag, the
        mean token lag, the fraction of trained tokens sampled by an older version than the one
        trained and of responses whose tokens span versions, and the dropped groups apart: their
        count and mean response length beside the trained ones' (rollout/response_length mixes
        both); over all ranks."""
        c = rollout.async_counts
        names = [n for n in c if n not in ("staleness_max", "engine_seconds")]
        tot = dict(zip(names, all_reduce_sum([float(c[n]) for n in names])))
        samples, tokens = max(tot["samples"], 1.0), max(tot["tokens"], 1.0)
        out = {"async/staleness_mean": tot["staleness_sum"] / samples,
               "async/staleness_max": all_reduce_max(c["staleness_max"]),
               "async/token_lag_mean": tot["token_lag_sum"] / tokens,
               "async/stale_token_fraction": tot["stale_tokens"] / tokens,
               "async/spanning_responses": tot["spanning"] / samples,
               "async/trained_response_length": tot["trained_length_sum"] / samples,
               "async/dropped_response_length": tot["dropped_length_sum"] / max(tot["dropped_samples"], 1.0),
               "async/dropped_groups": tot["dropped_groups"],
               "timing/engine_generation": all_reduce_max(c["engine_seconds"])}
        for n in names:
            if n.startswith("staleness_hist/"):
                out[f"async/{n}"] = tot[n] / samples
            elif n.startswith("tokens_lag/"):
                out[f"async/{n}"] = tot[n]
        return out

    def metrics(self, step: int, rollout: Rollout) -> dict:
        """The rollout's metrics over all ranks: rewards and lengths of every generated sample
        (dynamic sampling's dropped groups too), faults (the rollout's, counted when it finished,
        and the push's since), the data source's, staleness (steps between the generating and the
        trained weights) and, with dynamic sampling, its rounds and group counts. Collective."""
        a = self.cfg.algo
        tot = all_reduce_sum([rollout.reward_sum, rollout.generated, rollout.length_sum])
        out = dict(rollout.source_metrics)
        out.update(fault_metrics(rollout.fault_counts, *self.fault_counters))
        out["rollout/staleness"] = float(step - 1 - rollout.weights_step)
        out["timing/generation"] = all_reduce_max(rollout.seconds)
        if a.dynamic_sampling:
            out.update(self._dynamic_metrics(step, rollout))
        if rollout.async_counts:
            out.update(self._async_metrics(rollout))
        out["reward/mean"] = tot[0] / max(tot[1], 1)
        out["rollout/response_length"] = tot[2] / max(tot[1], 1)
        return out

    def lineage(self, step: int, rollout: Rollout) -> list:
        """prompts.jsonl's rows of `step`, one per rank: the draw numbers (in that rank's prompt
        stream) of the prompts the step trains (in batch order) and of those it dropped (in draw
        order), and their Prompt.uid in the same order. Collective."""
        dropped = sorted(zip(rollout.dropped_draws, rollout.dropped_prompts))
        mine = {"trained": list(rollout.trained_draws), "dropped": [d for d, _ in dropped],
                "trained_prompts": list(rollout.trained_prompts), "dropped_prompts": [u for _, u in dropped]}
        return [{"step": step, "rank": r, **row} for r, row in enumerate(all_gather_objects(mine))]

    def _dynamic_metrics(self, step: int, rollout: Rollout) -> dict:
        a = self.cfg.algo
        kept, dropped, filler, surplus = all_reduce_sum([rollout.kept_groups, rollout.dropped_groups,
                                                         rollout.filler_groups, rollout.surplus_groups])
        rounds = all_reduce_max(rollout.rounds)
        if filler and is_main_rank():
            log.warning("dynamic sampling: step %d found %d of algo.rollout_batch_size=%d informative groups in %d "
                        "round(s) (algo.max_sampling_rounds=%d); training on those plus %d all-equal (zero-advantage) "
                        "groups", step, int(kept), a.rollout_batch_size, int(rounds), a.max_sampling_rounds,
                        int(filler))
        return {"rollout/sampling_rounds": rounds, "rollout/kept_groups": kept, "rollout/dropped_groups": dropped,
                "rollout/filler_groups": filler, "rollout/surplus_groups": surplus}
