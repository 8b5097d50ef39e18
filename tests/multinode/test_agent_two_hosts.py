"""An agent on another host trains through the endpoint (rollout.agent_host, per-episode secrets),
across the two network-namespace hosts of tests/multinode/conftest.py: a one-step run of
`+exp=agent_endpoint` on the tiny model on host 0, its endpoint bound to host 0's address; its
agent, `rollout.agent="cmd: ..."`, starts each episode's program on host 1 (launch/netns_two_nodes.sh
exec, as a sandbox launcher starts an agent on another machine) with an unmodified `openai` client.

Each program (on host 1) checks what the endpoint refuses before it trains: a call with its bare
episode id and no token (401), a call for its own episode with the other episode's secret (403),
the other episode's reward posted with its own token as the API key (403); then its call and its
reward through OPENAI_BASE_URL / DSRL_REWARD_URL succeed and the step trains both episodes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "netns_two_nodes.sh"

# One episode's program on host 1. The two episodes of the group swap tokens through a file (to try
# each other's secret), then train as any OpenAI client program does.
AGENT = r'''
import json, os, socket, sys, time
import httpx, openai

task = json.load(sys.stdin)
token = os.environ["DSRL_EPISODE_ID"]  # off loopback: {id}.{secret}
eid, _, secret = token.partition(".")
base = os.environ["OPENAI_BASE_URL"]
root = base.split("/episodes/")[0]
out = os.environ["DSRL_TEST_OUT"]
with open(f"{out}.{eid}", "w") as f:
    f.write(token)
other = eid[:-1] + ("1" if eid.endswith("0") else "0")  # r1-e0 <-> r1-e1
for _ in range(600):
    if os.path.exists(f"{out}.{other}"):
        break
    time.sleep(0.05)
other_secret = open(f"{out}.{other}").read().partition(".")[2]
body = {"model": "m", "messages": task["messages"]}
row = {"episode": eid, "host": socket.gethostname(), "base": base, "token": bool(secret)}
row["bare id"] = httpx.post(f"{root}/v1/chat/completions", json=body, headers={"X-Episode-Id": eid},
                            timeout=60).status_code
row["my id, other's secret"] = httpx.post(f"{root}/episodes/{eid}.{other_secret}/v1/chat/completions", json=body,
                                          timeout=60).status_code
row["other's reward, my key"] = httpx.post(f"{root}/v1/episodes/{other}/reward", json={"reward": 1.0},
                                           headers={"Authorization": f"Bearer {token}"}, timeout=60).status_code
reply = openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=task["messages"])
row["chat"] = 200 if reply.choices else 0
row["reward"] = httpx.post(os.environ["DSRL_REWARD_URL"], json={"reward": 1.0}, timeout=60).status_code
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
'''


def test_an_agent_on_host_1_trains_through_the_endpoint_of_a_run_on_host_0(two_nodes, tiny_model_path, tmp_path):
    agent = tmp_path / "remote_agent.py"
    agent.write_text(AGENT)
    results, run_dir, log = tmp_path / "agent_rows.jsonl", tmp_path / "run", tmp_path / "run.log"
    launcher = f"{SCRIPT} exec {two_nodes.name} 1 {sys.executable} {agent}"  # the program, started on host 1
    args = [sys.executable, "-m", "dsrl.main", "+exp=agent_endpoint", f"model.path={tiny_model_path}",
            "rollout.backend=hf", "model.dtype=float32", "rollout.dtype=float32", "trainer.total_steps=1",
            "algo.rollout_batch_size=1", "algo.n_samples_per_prompt=2", "algo.global_batch_size=2",
            "rollout.max_new_tokens=8", "rollout.max_episode_tokens=64", "algo.entropy_coef=0.01",
            "rollout.agent_timeout_s=120", f"rollout.agent_host={two_nodes.addrs[0]}",
            f"rollout.agent='cmd: {launcher}'", "trainer.save_every=0", "trainer.save_final=false",
            "logger.plot=false", "logger.tensorboard=false", f"hydra.run.dir={run_dir}"]
    env = subprocess_env(RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
                         DSRL_TEST_OUT=str(results))
    with open(log, "w") as f:
        p = two_nodes.popen(0, args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            rc = p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"the run on host 0 did not finish in 600 s:\n{log.read_text()[-4000:]}")
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    assert f"agent endpoint: serving http://{two_nodes.addrs[0]}:" in text
    rows = sorted((json.loads(line) for line in results.read_text().splitlines()), key=lambda r: r["episode"])
    assert [r["episode"] for r in rows] == ["r1-e0", "r1-e1"], rows
    for r in rows:
        assert r["host"] == two_nodes.hosts[1] and r["base"].startswith(f"http://{two_nodes.addrs[0]}:"), r
        assert r["token"] and f"/episodes/{r['episode']}." in r["base"], r
        assert (r["bare id"], r["my id, other's secret"], r["other's reward, my key"]) == (401, 403, 403), r
        assert (r["chat"], r["reward"]) == (200, 200), r
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    m = metrics[0]
    assert m["agent/finish_rewarded"] == 1.0 and m["agent/reward"] == 1.0 and m["agent/calls"] == 1.0
    assert m["agent/refused_requests"] == 6.0  # the three refusals of each program
    assert m["rollout/response_length"] == pytest.approx(m["agent/model_tokens"]) and m["train/grad_norm"] > 0
