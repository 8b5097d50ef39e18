"""The OpenAI-compatible endpoint a black-box agent is trained through (`rollout.agent_endpoint`).

During a run, each rank serves on loopback (or on `rollout.agent_host`, where every request
carries its episode's token {id}.{secret}: EpisodeBook.authorize), from its own rollout engine
(the policy's latest weights; its LoRA adapter too):
- POST /v1/chat/completions  (the chat template applied server side, once; function tools, streaming:
                              dsrl.agent.endpoint.chat)
- POST /v1/responses         (the Responses API subset: dsrl.agent.endpoint.responses)
- POST /v1/completions       (a plain prompt string)
- POST /inference/v1/generate  (token ids in and out: dsrl.agent.endpoint.generate)
- POST /v1/episodes/{id}/reward  {"reward": r}: closes the episode
- GET  /v1/models (with max_model_len), /healthz
A call names its episode with the `X-Episode-Id` header or the `user` field, or is made under the
episode's own base URL {server}/episodes/{id}/v1 (the same routes; .../v1/reward for the reward). Refusals are typed
OpenAI-style errors ({"error": {"message", "type", "param", "code"}}) with their HTTP status:
400 bad field (a message the chat template refuses included), 401 no token off loopback, 403 a
wrong secret or another episode's token, 404 unknown episode, 408 timed out, 409 closed episode /
reward twice, 413 over a limit (body bytes, max_tokens, context), 429 over rollout.max_turns
calls; the run goes on. A retried request joins its call in flight; a call whose clients all
disconnected is not trained (dsrl.agent.endpoint.book).

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
from fastapi.responses import JSONResponse, Response

from dsrl.actor.batch import Sample
from dsrl.agent.endpoint.book import (CALL_SEED_STRIDE, FAILED_EPISODES, EndpointError, Episode, EpisodeBook, Limits,
                                      episode_trajectories, request_key, round_metrics)
from dsrl.agent.episodes import trajectories_to_samples
from dsrl.registry import PluginError, load_callable

log = logging.getLogger("dsrl")

AGENT_KEY = "rollout.agent"


class CommandAgent:
    """An agent that is a program (`rollout.agent="cmd: PROGRAM ARGS"`), run once per episode: the
    task as JSON on its stdin; in its environment OPENAI_BASE_URL (the episode's own base URL,
    {server}/episodes/{ref}/v1, so any OpenAI client works unchanged), OPENAI_API_KEY and
    DSRL_EPISODE_ID (both the episode's ref: its id, or off loopback its token {id}.{secret}) and
    DSRL_REWARD_URL ({OPENAI_BASE_URL}/reward, where it POSTs {"reward": r}). A non-zero exit is the
    agent's error (its stderr's last lines in the message).

    Each program runs in a session of its own; its process group (the program and whatever it
    started) is killed with SIGKILL when its episode times out (`stop` set) and at the end of the
    round (`end_round`), so nothing of it outlives the round."""

    POLL_S = 0.2  # how often a running program's episode is checked for its end

    def __init__(self, command: str):
        import shlex

        self.argv = shlex.split(command)
        if not self.argv:
            raise PluginError(f"{AGENT_KEY}='cmd:': no program given")
        self._groups: set = set()  # process groups of this round's programs
        self._lock = threading.Lock()

    def __call__(self, base_url: str, episode_id: str, task: dict, stop: Optional[threading.Event] = None) -> None:
        import subprocess

        root = base_url[:-len("/v1")] if base_url.endswith("/v1") else base_url
        scoped = f"{root}/episodes/{episode_id}/v1"
        env = dict(os.environ, OPENAI_BASE_URL=scoped, OPENAI_API_KEY=episode_id, DSRL_EPISODE_ID=episode_id,
                   DSRL_REWARD_URL=f"{scoped}/reward")
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        with self._lock:
            self._groups.add(proc.pid)  # its own session: process group id = its pid
        feed, killed = json.dumps(task), False
        while True:
            try:
                _, err = proc.communicate(feed, timeout=self.POLL_S)
                break
            except subprocess.TimeoutExpired:
                feed = None  # sent once
                if stop is not None and stop.is_set() and not killed:
                    killed = self._kill(proc.pid)
        if killed:
            raise RuntimeError(f"{' '.join(self.argv)} was killed (its process group) at its episode's end")
        if proc.returncode != 0:
            tail = " | ".join((err or "").strip().splitlines()[-3:])
            raise RuntimeError(f"{' '.join(self.argv)} exited with {proc.returncode}: {tail}")

    @staticmethod
    def _kill(group: int) -> bool:
        import signal

        try:
            os.killpg(group, signal.SIGKILL)
            return True
        except (ProcessLookupError, PermissionError):  # nothing of it left
            return False

    def end_round(self) -> None:
        """Kill what is left of this round's programs (their process groups)."""
        with self._lock:
            groups, self._groups = self._groups, set()
        for group in groups:
            if self._kill(group):
                log.info("agent endpoint: killed the process group %d left by %s at the end of the round", group,
                         self.argv[0])


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
        """The episode id the request acts for, its token checked (EpisodeBook.authorize): named by
        the scoped path, the X-Episode-Id header or the `user` field, or by an API key that is a token."""
        ref = scoped or request.headers.get("x-episode-id") or body.get("user")
        auth = request.headers.get("authorization") or ""
        key = auth[len("bearer "):].strip() if auth[:len("bearer ")].lower() == "bearer " else None
        return book.authorize(ref if isinstance(ref, str) else None, key)

    async def await_call(request: Request, call) -> Optional[dict]:
        """The call's completion; None when the client disconnected first (then the call has one
        client less: with none left it is not trained, EpisodeBook.detach)."""
        done = asyncio.wrap_future(call.future)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: never "exception not retrieved"

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watch.done():
                watch.cancel()
        if done.done():
            return done.result()
        book.detach(call)
        return None

    async def serve(request: Request, route: str, scoped: Optional[str] = None):
        """`route`: one of dsrl.agent.endpoint.routes.ROUTES (how the body becomes a call and its reply)."""
        eid = scoped
        try:
            body = await body_of(request)
            eid = episode_of(request, body, scoped)
            submit, answer = endpoint.protocols.prepare(route, eid, body)
            call = book.submit(eid, request_key(route, body), submit)
            out = await await_call(request, call)
        except EndpointError as e:
            book.refuse()
            return _reply(e)
        if out is None:  # the client is gone: nobody reads this
            return Response(status_code=499)
        return answer(out)

    # Each protocol route, at the root and under an episode's own base URL ({base}/episodes/{id}/v1):
    # an unmodified program that reads OPENAI_BASE_URL needs no header (command agents get that URL).
    def add_routes(path: str, route: str) -> None:
        async def at_root(request: Request):
            return await serve(request, route)

        async def under_episode(episode_id: str, request: Request):
            return await serve(request, route, scoped=episode_id)

        app.add_api_route(path, at_root, methods=["POST"], name=route)
        app.add_api_route(f"/episodes/{{episode_id}}{path}", under_episode, methods=["POST"], name=f"scoped_{route}")

    for path, route in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
                        ("/v1/responses", "responses"), ("/inference/v1/generate", "generate")):
        add_routes(path, route)

    @app.post("/episodes/{episode_id}/v1/reward")
    async def scoped_reward(episode_id: str, request: Request):
        return await reward(episode_id, request)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        try:
            body = await body_of(request)
            episode_id = episode_of(request, {}, episode_id)
            if "reward" not in body:
                raise EndpointError(400, "invalid_reward", "the body needs a 'reward' field", param="reward")
            value = book.set_reward(episode_id, body["reward"])
        except EndpointError as e:
            book.refuse()
            return _reply(e)
        return {"episode": episode_id, "reward": value, "status": "closed"}

    @app.get("/v1/models")
    @app.get("/episodes/{episode_id}/v1/models")  # under an episode's base URL too (what OPENAI_BASE_URL names)
    async def models():
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "dsrl",
                                            "max_model_len": endpoint.limits.max_model_len}]}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


BARRIER_WARN_S = 30.0  # calls held this long by episodes that never called: warned (or half the agent timeout)


def is_loopback(host: str) -> bool:
    """Whether a bind address serves only this host (no secret is needed there)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolved by the server
        import socket

        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def advertised_host(host: str) -> str:
    """The address agents use for a bind address: itself, or for a wildcard (0.0.0.0, ::) this
    host's address as its name resolves."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import socket

    return socket.gethostbyname(socket.gethostname())


class AgentEndpoint:
    """The endpoint of one rank: an HTTP server in a daemon thread, the episode book, and the round
    driver (`run_round`), which is the only caller of the rollout worker."""

    def __init__(self, worker, tokenizer, *, limits: Limits, agent: Callable, model_name: str = "dsrl-policy",
                 timeout_s: float = 300.0, max_request_bytes: int = 1 << 20, host: str = "127.0.0.1",
                 port: Optional[int] = None, failed_episodes: str = "zero", tool_parser: str = "hermes",
                 tool_template: str = "auto", stop_strings: bool = True):
        from dsrl.agent.endpoint.routes import Protocols
        from dsrl.distributed.ports import free_port

        if failed_episodes not in FAILED_EPISODES:
            raise ValueError(f"rollout.failed_episodes={failed_episodes!r}: one of {' | '.join(FAILED_EPISODES)}")
        self.worker, self.tok, self.agent, self.model_name = worker, tokenizer, agent, model_name
        self.limits, self.timeout_s, self.max_request_bytes = limits, float(timeout_s), int(max_request_bytes)
        self.failed_episodes = failed_episodes
        # Off loopback (rollout.agent_host), every request carries its episode's token.
        self.book = EpisodeBook(tokenizer, limits, require_secret=not is_loopback(host),
                                barrier_warn_s=min(BARRIER_WARN_S, self.timeout_s / 2))
        # the request protocols of the routes; stop_strings: the worker takes stop strings (not rollout.backend=hf)
        self.protocols = Protocols(self, tool_parser=tool_parser, tool_template=tool_template, stop_strings=stop_strings)
        self.host, self.port = host, int(port or free_port())
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._serial = 0

    @property
    def base_url(self) -> str:
        """The URL agents reach the server at (a wildcard bind address: this host's address)."""
        host = advertised_host(self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

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
    def openai_reply(self, out: dict, *, with_logprobs: bool, episode_id: Optional[str]) -> dict:
        """The reply to /v1/completions (chat replies: dsrl.agent.endpoint.chat.chat_reply)."""
        created = int(time.time())
        usage = {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                 "total_tokens": out["prompt_tokens"] + out["completion_tokens"]}
        lps = None
        if with_logprobs:
            toks = [self.tok.decode([t]) for t in out["token_ids"]]
            lps = {"tokens": toks, "token_logprobs": list(out["logprobs"]), "top_logprobs": None, "text_offset": None}
        rid = f"cmpl-{episode_id}-{out['prompt_tokens']}"
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
            if isinstance(self.agent, CommandAgent):
                self.agent.end_round()  # program agents' process groups: nothing outlives the round
        trajs, groups, episode_ids, dropped = [], [], [], []
        for ep in ended:
            if ep.agent_error:
                log.warning("agent endpoint: the agent of episode %s raised: %s", ep.id, ep.agent_error)
            if ep.failed and self.failed_episodes == "drop":  # an infrastructure fault is not a reward of 0
                dropped.append(ep.id)
                continue
            for t in episode_trajectories(ep):
                trajs.append(t)
                groups.append(ep.group)
                episode_ids.append(ep.id)
        failed = [ep.id for ep in ended if ep.failed]
        if failed:
            log.warning("agent endpoint: %d episode(s) failed (agent error or timeout, no reward): %s; %s",
                        len(failed), ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else ""),
                        "left out of their groups (rollout.failed_episodes=drop)" if dropped else
                        "trained with reward 0 (rollout.failed_episodes=zero)")
        if not trajs:  # nothing to train: say why, naming the agent (a silent empty step would hide it)
            why = sorted({ep.agent_error or ep.finish_reason for ep in ended})[:3]
            raise RuntimeError(f"{AGENT_KEY}: none of the {len(ended)} episodes of this round got a completion from "
                               f"{self.base_url}{' that is trained' if dropped else ''} ({'; '.join(why)})")
        metrics = round_metrics(ended, trajs, refused, dropped=len(dropped))
        samples = trajectories_to_samples(trajs, groups, self.tok, index_offset)
        for s, eid in zip(samples, episode_ids):
            s.extra["episode"] = eid  # the advantage's group statistics count each episode once
        return samples, metrics

    def _run_agent(self, ep: Episode) -> None:
        error = None
        ref = ep.token if self.book.require_secret else ep.id  # what the agent names its episode by
        extra = {"stop": ep.stop} if isinstance(self.agent, CommandAgent) else {}
        try:
            self.agent(base_url=self.base_url, episode_id=ref, task=ep.task, **extra)
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
            # each call generates up to its own limit and stops at its own stop strings
            stops = [list(c.request.stop) if c.request is not None else [] for c in batch]
            groups = self.worker.generate([c.prompt_ids for c in batch], n=1, temperature=lim.temperature,
                                          top_p=lim.top_p, max_tokens=[c.max_tokens for c in batch],
                                          seeds=[c.episode.seed + c.number for c in batch],
                                          **({"stop": stops} if any(stops) else {}))
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
