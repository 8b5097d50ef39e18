"""The OpenAI-compatible endpoint a black-box agent is trained through (`rollout.agent_endpoint`).

During a run, each rank serves on loopback, from its own rollout engine (the policy's latest
weights; its LoRA adapter too):
- POST /v1/chat/completions  (the chat template applied server side, once)
- POST /v1/completions       (a plain prompt string)
- POST /v1/episodes/{id}/reward  {"reward": r}: closes the episode
- GET  /v1/models, /healthz
A call names its episode with the `X-Episode-Id` header or the `user` field, or is made under the
episode's own base URL {server}/episodes/{id}/v1 (the same routes; .../v1/reward for the reward). Refusals are typed
OpenAI-style errors ({"error": {"message", "type", "param", "code"}}) with their HTTP status:
400 bad field, 404 unknown episode, 408 timed out, 409 closed episode / reward twice, 413 over a
limit (body bytes, max_tokens, context), 429 over rollout.max_turns calls; the run goes on.

A rollout round opens one episode per (prompt, sample), runs the agent function (`rollout.agent`,
`fn(base_url, episode_id, task)`, task = the prompt as plain data) for each in its own thread, and
drives the engine from the round's thread by counts (dsrl.agent.endpoint.book). The agent needs
no dsrl import: it is any code that speaks the OpenAI API; `rollout.agent="cmd: PROGRAM ARGS"` runs
a program per episode instead, with OPENAI_BASE_URL set to the episode's own base URL
(CommandAgent)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dsrl.actor.batch import Sample
from dsrl.agent.endpoint.book import (CALL_SEED_STRIDE, EndpointError, Episode, EpisodeBook, Limits,
                                      episode_trajectories, round_metrics)
from dsrl.agent.episodes import trajectories_to_samples
from dsrl.registry import PluginError, load_callable

log = logging.getLogger("dsrl")

AGENT_KEY = "rollout.agent"


class CommandAgent:
    """An agent that is a program (`rollout.agent="cmd: PROGRAM ARGS"`), run once per episode: the
    task as JSON on its stdin; in its environment OPENAI_BASE_URL (the episode's own base URL,
    {server}/episodes/{id}/v1, so any OpenAI client works unchanged), OPENAI_API_KEY, DSRL_EPISODE_ID
    and DSRL_REWARD_URL ({OPENAI_BASE_URL}/reward, where it POSTs {"reward": r}). A non-zero exit
    is the agent's error (its stderr's last lines in the message)."""

    def __init__(self, command: str):
        import shlex

        self.argv = shlex.split(command)
        if not self.argv:
            raise PluginError(f"{AGENT_KEY}='cmd:': no program given")

    def __call__(self, base_url: str, episode_id: str, task: dict) -> None:
        import subprocess

        root = base_url[:-len("/v1")] if base_url.endswith("/v1") else base_url
        scoped = f"{root}/episodes/{episode_id}/v1"
        env = dict(os.environ, OPENAI_BASE_URL=scoped, OPENAI_API_KEY="dsrl", DSRL_EPISODE_ID=episode_id,
                   DSRL_REWARD_URL=f"{scoped}/reward")
        r = subprocess.run(self.argv, input=json.dumps(task), capture_output=True, text=True, env=env)
        if r.returncode != 0:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"{' '.join(self.argv)} exited with {r.returncode}: {tail}")


def load_agent(path: str) -> Callable:
    """`pkg.module:fn`, `pkg.module.fn`, `path/to/file.py:fn` (relative to the working directory), or
    `cmd: PROGRAM ARGS` (a program run per episode: CommandAgent)."""
    if not path:
        raise PluginError(f"{AGENT_KEY} is empty: name the agent function (pkg.module:fn or file.py:fn) "
                          f"or program (cmd: PROGRAM ARGS)")
    if path.startswith("cmd:"):
        agent = CommandAgent(path[len("cmd:"):])
        import shutil

        if shutil.which(agent.argv[0]) is None:
            raise PluginError(f"{AGENT_KEY}={path!r}: no program {agent.argv[0]!r} on PATH")
        return agent
    file, sep, attr = path.rpartition(":")
    if sep and file.endswith(".py"):
        if not os.path.isfile(file):
            raise PluginError(f"{AGENT_KEY}={path!r}: no file {os.path.abspath(file)}")
        spec = importlib.util.spec_from_file_location(f"dsrl_agent_{abs(hash(os.path.abspath(file)))}", file)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise PluginError(f"{AGENT_KEY}={path!r}: cannot load {file}: {e!r}") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise PluginError(f"{AGENT_KEY}={path!r}: {file} has no function {attr!r}")
        return fn
    return load_callable(path, AGENT_KEY)


def _reply(err: EndpointError):
    return JSONResponse(err.body(), status_code=err.status)


def build_app(endpoint: "AgentEndpoint") -> FastAPI:
    app = FastAPI(title="dsrl agent endpoint")
    book = endpoint.book

    async def body_of(request: Request) -> dict:
        limit = endpoint.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise EndpointError(413, "request_too_large", f"request body of {declared} bytes is over "
                                f"rollout.agent_max_request_bytes={limit}")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise EndpointError(413, "request_too_large", f"request body is over rollout.agent_max_request_bytes={limit}")
            parts.append(part)
        try:
            body = json.loads(b"".join(parts) or b"{}")
        except ValueError as e:
            raise EndpointError(400, "invalid_json", f"body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "invalid_json", "body must be a JSON object")
        return body

    def episode_of(request: Request, body: dict, scoped: Optional[str]) -> Optional[str]:
        eid = scoped or request.headers.get("x-episode-id") or body.get("user")
        return eid if isinstance(eid, str) else None

    async def serve(request: Request, chat: bool, scoped: Optional[str] = None):
        eid = scoped
        try:
            body = await body_of(request)
            eid = episode_of(request, body, scoped)
            call = book.submit_chat(eid, body) if chat else book.submit_completion(eid, body)
            out = await asyncio.wrap_future(call.future)
        except EndpointError as e:
            book.refuse()
            return _reply(e)
        return endpoint.openai_reply(out, chat=chat, with_logprobs=bool(body.get("logprobs")), episode_id=eid)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    # The same routes under an episode's own base URL ({base}/episodes/{id}/v1): an unmodified
    # program that reads OPENAI_BASE_URL needs no header (command agents get this URL).
    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def scoped_chat_completions(episode_id: str, request: Request):
        return await serve(request, chat=True, scoped=episode_id)

    @app.post("/episodes/{episode_id}/v1/completions")
    async def scoped_completions(episode_id: str, request: Request):
        return await serve(request, chat=False, scoped=episode_id)

    @app.post("/episodes/{episode_id}/v1/reward")
    async def scoped_reward(episode_id: str, request: Request):
        return await reward(episode_id, request)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        try:
            body = await body_of(request)
            if "reward" not in body:
                raise EndpointError(400, "invalid_reward", "the body needs a 'reward' field", param="reward")
            value = book.set_reward(episode_id, body["reward"])
        except EndpointError as e:
            book.refuse()
            return _reply(e)
        return {"episode": episode_id, "reward": value, "status": "closed"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "dsrl"}]}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


class AgentEndpoint:
    """The endpoint of one rank: an HTTP server in a daemon thread, the episode book, and the round
    driver (`run_round`), which is the only caller of the rollout worker."""

    def __init__(self, worker, tokenizer, *, limits: Limits, agent: Callable, model_name: str = "dsrl-policy",
                 timeout_s: float = 300.0, max_request_bytes: int = 1 << 20, host: str = "127.0.0.1",
                 port: Optional[int] = None):
        from dsrl.distributed.ports import free_port

        self.worker, self.tok, self.agent, self.model_name = worker, tokenizer, agent, model_name
        self.limits, self.timeout_s, self.max_request_bytes = limits, float(timeout_s), int(max_request_bytes)
        self.book = EpisodeBook(tokenizer, limits)
        self.host, self.port = host, int(port or free_port())
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._serial = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> "AgentEndpoint":
        import uvicorn

        config = uvicorn.Config(build_app(self), host=self.host, port=self.port, log_level="warning",
                                access_log=False, timeout_keep_alive=75)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="dsrl-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.base_url}")
            time.sleep(0.02)
        log.info("agent endpoint: serving %s (OpenAI-compatible; episodes by X-Episode-Id or `user`)", self.base_url)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None

    # ------------------------------------------------------------------ replies
    def openai_reply(self, out: dict, *, chat: bool, with_logprobs: bool, episode_id: Optional[str]) -> dict:
        created = int(time.time())
        usage = {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                 "total_tokens": out["prompt_tokens"] + out["completion_tokens"]}
        lps = None
        if with_logprobs:
            toks = [self.tok.decode([t]) for t in out["token_ids"]]
            lps = ({"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(toks, out["logprobs"])]} if chat
                   else {"tokens": toks, "token_logprobs": list(out["logprobs"]), "top_logprobs": None, "text_offset": None})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{episode_id}-{out['prompt_tokens']}"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                      "finish_reason": out["finish_reason"], "logprobs": lps}
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": out["text"], "finish_reason": out["finish_reason"], "logprobs": lps}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice], "usage": usage}

    # ------------------------------------------------------------------ one rollout round
    def run_round(self, tasks: Sequence[Any], *, n: int, seeds: Sequence[int], show_progress: bool = False,
                  index_offset: int = 0) -> Tuple[List[Sample], dict]:
        """`n` episodes per task (group g = task g), the agent run once per episode; the trained
        Samples (every sequence of every episode that got a completion) and the agent/* metrics."""
        if len(seeds) != len(tasks):
            raise ValueError(f"{len(seeds)} seeds for {len(tasks)} tasks")
        self._serial += 1
        now = time.monotonic()
        episodes = []
        for g, task in enumerate(tasks):
            data = task.to_dict() if hasattr(task, "to_dict") else task
            for k in range(n):
                i = len(episodes)
                episodes.append(Episode(f"r{self._serial}-e{i}", i, g, int(seeds[g]) + k * CALL_SEED_STRIDE, data,
                                        self.timeout_s, now))
        self.book.open(episodes)
        threads = [threading.Thread(target=self._run_agent, args=(ep,), name=f"dsrl-agent-{ep.id}", daemon=True)
                   for ep in episodes]
        for t in threads:
            t.start()
        try:
            self._drive(episodes, show_progress)
        finally:
            ended = self.book.close_round()
            refused = self.book.refused
        trajs, groups = [], []
        for ep in ended:
            for t in episode_trajectories(ep):
                trajs.append(t)
                groups.append(ep.group)
            if ep.agent_error:
                log.warning("agent endpoint: the agent of episode %s raised: %s", ep.id, ep.agent_error)
        if not trajs:  # nothing to train: say why, naming the agent (a silent empty step would hide it)
            why = sorted({ep.agent_error or ep.finish_reason for ep in ended})[:3]
            raise RuntimeError(f"{AGENT_KEY}: none of the {len(ended)} episodes of this round got a completion from "
                               f"{self.base_url} ({'; '.join(why)})")
        metrics = round_metrics(ended, trajs, refused)
        return trajectories_to_samples(trajs, groups, self.tok, index_offset), metrics

    def _run_agent(self, ep: Episode) -> None:
        error = None
        try:
            self.agent(base_url=self.base_url, episode_id=ep.id, task=ep.task)
        except BaseException as e:  # the agent's failure ends its episode, not the run
            error = f"{type(e).__name__}: {e}"
        self.book.agent_finished(ep, error)

    def _drive(self, episodes: Sequence[Episode], show_progress: bool) -> None:
        """Run the engine on each batch the book releases until the round is over."""
        bar = None
        if show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(episodes), desc="agent episodes", unit="ep", leave=False, dynamic_ncols=True)
        try:
            while True:
                if bar is not None:
                    bar.update(sum(not ep.live for ep in episodes) - bar.n)
                batch = self.book.next_batch()
                if batch is None:
                    return
                self._generate(batch)
        finally:
            if bar is not None:
                bar.close()

    def _generate(self, batch) -> None:
        """One batched engine call for the released calls; each completion recorded and answered."""
        lim = self.limits
        try:
            groups = self.worker.generate([c.prompt_ids for c in batch], n=1, temperature=lim.temperature,
                                          top_p=lim.top_p, max_tokens=max(c.max_tokens for c in batch),
                                          seeds=[c.episode.seed + c.number for c in batch])
            if len(groups) != len(batch):
                raise RuntimeError(f"the engine answered {len(groups)} of {len(batch)} calls")
        except BaseException as e:
            self.book.fail(batch, e)
            raise
        for i, (call, group) in enumerate(zip(batch, groups)):
            c = group[0]
            try:
                out = self.book.record(call, list(c.token_ids), list(c.logprobs), str(c.finish_reason))
            except BaseException as e:
                self.book.fail(batch[i:], e)
                raise
            call.future.set_result(out)
