"""One verifiers 0.4 episode (or the listing of a taskset's tasks), run with the verifiers venv's
interpreter (.venv-verifiers, made by launch/setup.sh): it imports verifiers and the standard
library only, never dsrl (verifiers pins openai<3 and mcp==2.0.0, dsrl's venv has other versions).

    python verifiers_episode.py list TASKSET [--limit N]   # JSON lines {idx, id, name, prompt, system_prompt}
    python verifiers_episode.py run                         # one episode: an agent program of dsrl's endpoint

`run` is started once per episode by dsrl's agent endpoint (rollout.agent="cmd: ..."): the task on
stdin as JSON ({messages, answer, meta: {taskset, idx, max_turns, temperature, max_tokens}}), the
episode's own base URL in OPENAI_BASE_URL and its key in OPENAI_API_KEY. It loads the taskset as a
verifiers environment with the `null` harness (a plain chat loop) in the `subprocess` runtime, runs
the task's episode against that base URL through verifiers' eval client (every model call relayed
as a streamed Chat Completions request), and POSTs the trace's reward to DSRL_REWARD_URL. An episode
that is not `ok` (a reward that raised, a harness error, a timeout) posts nothing and exits 1 naming
the errors: dsrl counts that episode as failed (rollout.failed_episodes). With DSRL_VERIFIERS_TRACES
set, each episode also appends {episode, idx, ok, reward, errors} to that file (for checks). uv's
cache and HOME point into <project>/.cache/verifiers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
from pathlib import Path

# The null harness starts its script with `uv` (from this venv) and caches what uv installs: both
# inside the project, never in the user's home.
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "verifiers"
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault("UV_CACHE_DIR", str(CACHE / "uv"))
os.environ["HOME"] = str(CACHE / "home")


def _env(taskset: str, max_turns: int):
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig(taskset={"id": taskset},
                                     agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"},
                                            "max_turns": max_turns})
    return vf.load_environment(config)


def _prompt_messages(data) -> list:
    prompt = data.prompt
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    out = []
    for m in prompt:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({"role": d.get("role", "user"), "content": d.get("content", "")})
    return out


def list_tasks(taskset: str, limit: int) -> int:
    env = _env(taskset, 1)
    for n, task in enumerate(env.taskset):
        if limit and n >= limit:
            break
        d = task.data
        print(json.dumps({"idx": d.idx, "id": d.id, "name": d.name, "prompt": _prompt_messages(d),
                          "system_prompt": d.system_prompt}), flush=True)
    return 0


def _task_at(env, idx: int):
    for task in env.taskset:
        if task.data.idx == idx:
            return task
    raise LookupError(f"taskset has no task with idx {idx}")


async def _run_episode(task_json: dict) -> dict:
    import verifiers.v1 as vf

    meta = task_json.get("meta", {})
    env = _env(meta["taskset"], int(meta.get("max_turns", 1)))
    task = _task_at(env, int(meta["idx"]))
    sampling = {k: meta[k] for k in ("temperature", "max_tokens") if meta.get(k) is not None}
    ctx = vf.ModelContext(model=meta.get("model", "dsrl"),
                          client=vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"],
                                                     api_key_var="OPENAI_API_KEY"),
                          sampling=vf.SamplingConfig(**sampling))
    async with env.serving():
        episode = await env.run_slot(env.slots(task, n=1)[0], ctx)
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        errors += [f"{e.type}: {e.message}" for e in getattr(trace, "errors", [])]
    ok = bool(episode.ok) and len(episode.traces) == 1 and all(t.ok for t in episode.traces)
    reward = float(episode.traces[0].reward) if episode.traces and episode.traces[0].reward is not None else None
    reply = episode.traces[0].last_reply if episode.traces else None
    return {"idx": int(meta["idx"]), "ok": ok, "reward": reward, "errors": errors, "reply": reply}


def run() -> int:
    task_json = json.loads(sys.stdin.read())
    result = asyncio.run(_run_episode(task_json))
    record = os.environ.get("DSRL_VERIFIERS_TRACES")
    if record:
        with open(record, "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(result, episode=os.environ.get("DSRL_EPISODE_ID"))) + "\n")
    if not result["ok"] or result["reward"] is None:
        print(f"verifiers episode of task {result['idx']} is not ok: {'; '.join(result['errors']) or 'no reward'}",
              file=sys.stderr)
        return 1
    req = urllib.request.Request(os.environ["DSRL_REWARD_URL"], data=json.dumps({"reward": result["reward"]}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    ls = sub.add_parser("list")
    ls.add_argument("taskset")
    ls.add_argument("--limit", type=int, default=0)
    sub.add_parser("run")
    args = ap.parse_args()
    if args.cmd == "list":
        return list_tasks(args.taskset, args.limit)
    return run()


if __name__ == "__main__":
    sys.exit(main())
