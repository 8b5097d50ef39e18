"""The multi-node DeepSpeed launch across two hosts (network namespaces, tests/multinode/conftest.py):
one rank per node (gloo over the veth pair), the tiny model, ZeRO-3, node-local checkpoints, run as
a user runs it on two hosts without ssh (launch/multinode_deepspeed.sh --no-ssh, NODE_RANK per
host; docs/guides/multi-node.md).

A: two steps uninterrupted. One run folder (rank 0's timestamped name, on both nodes), metrics from
both ranks in rank 0's metrics.jsonl, identical parameters on both ranks after every step
(trainer.check_rank_sync), each node's checkpoint folder holding its own rank's shards.
B: SIGTERM to both nodes' process groups (as Ctrl-C or a batch system sends it) stops both after
step 1 with a checkpoint on each node. C: B resumed (the same folder), then its rank on node 1
SIGKILLed mid-step: node 0 stops within trainer.dist_timeout_s naming the lost rank and its host,
and no process survives on either node; the step-2 checkpoint and the metrics equal A's (file by
file). D: node 1 vanishes from the network (its link down, its connections left
open): both ranks stop after trainer.dist_timeout_s, each naming the other as the suspect.
E: a SLURM cluster of the two hosts (slurmctld and munged on node 0, a slurmd on each) runs
launch/slurm_example.sbatch as a user submits it: a Ray head and worker as srun steps
(launch/ray_cluster.sh), the hostfile from scontrol, both ranks started from node 0 through ssh
(launch/multinode_deepspeed.sh HOSTFILE: DeepSpeed's runner, pdsh, an sshd on each node), a
Ray-placed vLLM engine on each host serving both ranks; the same run folder, metrics and
checkpoints as A for two steps; then host 1's Ray node killed: the run stops naming the engine
and its host, the job ends FAILED with the trainer's exit status."""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch" / "multinode_deepspeed.sh"
SCRIPT_NETNS = ROOT / "launch" / "netns_two_nodes.sh"
SSH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"  # sshd's folder, off a user's PATH
DIST_TIMEOUT_S = 60  # trainer.dist_timeout_s of these runs: the bound on noticing a lost rank


def _e2e():
    """tests/e2e/test_e2e_resume.py's config and checkpoint comparison (one copy of each)."""
    if str(ROOT / "tests" / "e2e") not in sys.path:  # its e2e_jobs, when tests/e2e is not collected too
        sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    spec = importlib.util.spec_from_file_location("dsrl_e2e_resume", ROOT / "tests" / "e2e" / "test_e2e_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E2E = _e2e()
_base_equal = E2E._equal


def _equal(a, b, where: str) -> None:
    """E2E._equal, and an object without its own == (ZeRO-3's optimizer state holds DeepSpeed's
    LossScaler) compared by its attributes. Installed in this module's private copy of E2E only."""
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        assert type(a) is type(b), (where, type(a), type(b))
        return _base_equal(vars(a), vars(b), where)
    return _base_equal(a, b, where)


E2E._equal = _equal  # _base_equal's recursion reaches it through the module's globals
COMMON = [*E2E.TINY, "rollout.backend=hf", "actor.zero_stage=3", "actor.stage3_param_persistence_threshold=0",
          "trainer.total_steps=2", "trainer.save_every=1", "trainer.check_rank_sync=true",
          "trainer.checkpoint_storage=node_local", f"trainer.dist_timeout_s={DIST_TIMEOUT_S}"]
_ports = itertools.count(29511)


class Launch:
    """Both nodes' `multinode_deepspeed.sh --no-ssh`, each in its node's namespace; with ssh=True
    node 0's `multinode_deepspeed.sh HOSTFILE` alone (DeepSpeed's runner starts both nodes' ranks
    through pdsh/ssh; the nodes need launch/netns_two_nodes.sh sshd)."""

    def __init__(self, nodes, out: Path, *overrides: str, run_dir: Path | None = None, ssh: bool = False):
        hostfile = nodes.local / "hostfile"
        for n in (0, 1):
            nodes.on_node(n, hostfile).write_text("".join(f"{a} slots=1\n" for a in nodes.addrs))
        env = subprocess_env(RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1", DS_ACCELERATOR="cpu",
                             PYTHONUNBUFFERED="1", MASTER_PORT=str(next(_ports)))
        env.pop("RUN_DIR", None)
        if run_dir is not None:
            env["RUN_DIR"] = str(run_dir)
        started = (0,) if ssh else (0, 1)
        self.outs = [out.with_name(f"{out.name}.node{n}.log") for n in started]
        self.procs = []
        for n in started:
            argv = [LAUNCH, hostfile] if ssh else ["env", f"NODE_RANK={n}", LAUNCH, "--no-ssh", hostfile]
            with open(self.outs[n], "w") as f:
                self.procs.append(nodes.popen(n, [*argv, *COMMON, *overrides], env=env, stdout=f,
                                              stderr=subprocess.STDOUT))
        self.started = time.time()

    def wait(self, timeout: float = 300) -> list:
        end = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(end - time.time(), 1))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    _signal_group(q, signal.SIGKILL)
                raise AssertionError(f"two-node launch still running after {timeout} s:\n{self.tail()}")
        return [p.returncode for p in self.procs]

    def text(self, n: int) -> str:
        return self.outs[n].read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- node {n}:\n{self.text(n)[-chars:]}" for n in range(len(self.outs)))

    def check_ok(self, timeout: float = 300) -> None:
        assert self.wait(timeout) == [0] * len(self.procs), self.tail()


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _same_two_node_checkpoint(nodes, a: Path, b: Path, tmp: Path) -> None:
    """A's and B's checkpoint folders (paths under nodes.local) hold the same state on both nodes:
    each node's files, joined into one view, compared by E2E._same_checkpoint."""
    for name, folder in (("a", a), ("b", b)):
        view = tmp / f"view-{name}-{folder.name}"
        view.mkdir()
        for n in (0, 1):
            disk = nodes.on_node(n, folder)
            for f in disk.rglob("*"):
                rel = f.relative_to(disk)
                if f.is_file() and str(rel) != "COMPLETE.json":  # each node's own manifest
                    (view / rel).parent.mkdir(parents=True, exist_ok=True)
                    (view / rel).symlink_to(f)
    E2E._same_checkpoint(tmp / f"view-a-{a.name}", tmp / f"view-b-{b.name}")


def test_no_ssh_mode_needs_this_nodes_rank(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("10.77.0.1 slots=1\n10.77.0.2 slots=1\n")
    for rank in ("", "2", "x"):
        r = subprocess.run([str(LAUNCH), "--no-ssh", str(hostfile), "+exp=grpo_reuse"], capture_output=True, text=True,
                           env=subprocess_env(NODE_RANK=rank), timeout=60)
        assert r.returncode == 2 and "--no-ssh needs NODE_RANK=<0..1> (this node's line in" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def uninterrupted(two_nodes, tiny_model_path, tmp_path_factory):
    """Run A: two steps, the run folder named by rank 0 (a microsecond timestamp, which a node
    computing its own would not match). Returns (run folder as the nodes see it, seconds)."""
    logs = tmp_path_factory.mktemp("logs")
    runs = two_nodes.local / "runs"
    # Quoted: Hydra's override grammar takes a `%` inside an interpolation only in a quoted value.
    rank0_dir = "${dsrl_rank0:'" + str(runs) + "/${now:%H-%M-%S-%f}'}"
    run = Launch(two_nodes, logs / "a", f'hydra.run.dir="{rank0_dir}"')
    run.check_ok()
    seconds = time.time() - run.started
    names = [sorted(os.listdir(two_nodes.on_node(n, runs))) for n in (0, 1)]
    assert len(names[0]) == 1 and names[1] == names[0], names  # rank 0's folder name on both nodes
    return runs / names[0][0], seconds, run


def test_two_node_zero3_launch_one_run_folder_node_local_checkpoints(two_nodes, uninterrupted):
    a, seconds, run = uninterrupted
    _check_run_folder(two_nodes, a, run.text(0))
    print(f"two-node launch A (2 steps): {seconds:.1f} s")


def _check_run_folder(two_nodes, a: Path, out0: str, steps=(1, 2)) -> None:
    """Run folder `a` (as the nodes see it) of a two-node run, node 0's output `out0`: one run
    folder, rank 1 on node 1, both ranks' reduced metrics of `steps` (the first rows), each node's
    checkpoints of those steps its own rank's."""
    assert f"run dir: {a} | ranks: 2" in out0
    assert (f"ranks: rank 0 on host {two_nodes.hosts[0]} ({two_nodes.addrs[0]}), "
            f"rank 1 on host {two_nodes.hosts[1]} ({two_nodes.addrs[1]})") in out0, out0[-3000:]
    node0, node1 = two_nodes.on_node(0, a), two_nodes.on_node(1, a)
    rows = E2E.metric_rows(node0)[:len(steps)]
    assert [r["step"] for r in rows] == list(steps)
    for r in rows:
        # Summed over both ranks: one microbatch each (8 of the 16 samples).
        assert r["train/microbatches"] == 2.0 and r["train/trained_fraction"] == 1.0, r
        assert r["rollout/response_length"] == 8.0
        # ZeRO-3's gathered weights reached both nodes' samplers (the probe: first push, then every 32nd)
        assert r.get("rollout/sync_logprob_diff", 0.0) < 1e-4
    assert not (node1 / "metrics.jsonl").exists() and (node1 / "run.rank1.log").is_file()
    for step in steps:
        ck0, ck1 = node0 / "checkpoints" / f"step-{step:06d}", node1 / "checkpoints" / f"step-{step:06d}"
        f0 = {str(p.relative_to(ck0)) for p in ck0.rglob("*") if p.is_file()}
        f1 = {str(p.relative_to(ck1)) for p in ck1.rglob("*") if p.is_file()}
        assert {"rank-0.pt", "trainer_state.json", "hf/model.safetensors", "COMPLETE.json"} <= f0
        assert f1 == {"rank-1.pt", "COMPLETE.json", "deepspeed/zero_pp_rank_1_mp_rank_00_model_states.pt",
                      "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"}, f1
        assert not any("rank_1" in f or f == "rank-1.pt" for f in f0), f0


def _wait_until(pred, run, what: str, timeout: float = 300) -> None:
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, f"timed out waiting for {what}:\n{run.tail()}"
        assert all(p.poll() is None for p in run.procs), f"a node's launch ended before {what}:\n{run.tail()}"
        time.sleep(0.05)


def test_sigterm_stops_both_nodes_a_resumed_rank_killed_is_named_and_the_checkpoints_equal_the_uninterrupted_run(
        two_nodes, uninterrupted, tmp_path):
    """B: SIGTERM to both nodes after step 1 stops both with a checkpoint on each node. C: the run
    resumed from it (the same folder) loses its rank on node 1 to a SIGKILL mid-step; node 0
    names the lost rank and its host within trainer.dist_timeout_s, and no process survives on
    either node. The step-2 checkpoint (the SIGTERM's own or the resumed run's) equals the
    uninterrupted run's file by file, and so do the metrics: a resume from the newest complete
    checkpoint is exact, whether a SIGTERM or a lost rank ended the run before it."""
    a = uninterrupted[0]
    b = two_nodes.local / "b"
    longer = "trainer.total_steps=4"  # neither launch ends by itself before its signal
    run = Launch(two_nodes, tmp_path / "b", longer, run_dir=b)
    metrics = two_nodes.on_node(0, b) / "metrics.jsonl"
    _wait_until(lambda: metrics.exists() and metrics.read_text().strip(), run, "step 1")
    for p in run.procs:  # as Ctrl-C or a batch system's job signal: every process of each node
        _signal_group(p, signal.SIGTERM)
    rcs = run.wait(120)
    stopped = [re.search(r"dsrl: stopped by SIGTERM after step (\d+);", run.text(n)) for n in (0, 1)]
    assert all(stopped) and rcs[0] != 0, run.tail()
    step = int(stopped[0].group(1))
    assert step == int(stopped[1].group(1)) and step in (1, 2), run.tail()
    assert two_nodes.wait_empty(30) == [[], []]
    for n in (0, 1):
        assert (two_nodes.on_node(n, b) / "checkpoints" / f"step-{step:06d}" / "COMPLETE.json").is_file()

    # C: resumed; once it saved its first new step, the rank on node 1 dies mid-step.
    resumed = Launch(two_nodes, tmp_path / "c", longer, run_dir=b)
    done = [two_nodes.on_node(n, b) / "checkpoints" / f"step-{step + 1:06d}" / "COMPLETE.json" for n in (0, 1)]
    _wait_until(lambda: all(f.exists() for f in done), resumed, f"the resumed run's step-{step + 1} checkpoint")
    assert f"continuing after step {step}" in resumed.text(0), resumed.tail()
    rank1 = [pid for pid in two_nodes.pids(1) if b"dsrl.main" in Path(f"/proc/{pid}/cmdline").read_bytes()
             and b"deepspeed.launcher" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(rank1) == 1, rank1
    os.kill(rank1[0], signal.SIGKILL)  # mid-step (step + 2)
    killed = time.time()
    rc0 = resumed.procs[0].wait(timeout=DIST_TIMEOUT_S + 30)
    noticed = time.time() - killed
    resumed.wait(30)
    out0 = resumed.text(0)
    assert rc0 != 0, resumed.tail()
    lost = (f"dsrl: lost rank 1 on host {two_nodes.hosts[1]} ({two_nodes.addrs[1]}): a collective on rank 0 on "
            f"host {two_nodes.hosts[0]} ({two_nodes.addrs[0]}) failed")
    assert lost in out0, resumed.tail()
    assert noticed < DIST_TIMEOUT_S, noticed
    assert two_nodes.wait_empty(30) == [[], []]  # launchers and ranks gone on both nodes
    line = next(ln for ln in out0.splitlines() if ln.startswith("dsrl: lost rank"))
    print(f"SIGTERM stop after step {step}; resumed, node 0 stopped {noticed:.1f} s after the SIGKILL: {line}")

    _same_two_node_checkpoint(two_nodes, a / "checkpoints" / "step-000002", b / "checkpoints" / "step-000002",
                              tmp_path)
    rows_a = E2E.untimed(E2E.metric_rows(two_nodes.on_node(0, a)))
    assert E2E.untimed(E2E.metric_rows(two_nodes.on_node(0, b)))[:2] == rows_a


def test_a_vanished_host_stops_both_nodes_after_the_process_group_timeout(two_nodes, tiny_model_path, tmp_path):
    timeout_s = 10
    d = two_nodes.local / "d"
    run = Launch(two_nodes, tmp_path / "d", "trainer.total_steps=3", "trainer.save_every=0",
                 f"trainer.dist_timeout_s={timeout_s}", run_dir=d)
    metrics = two_nodes.on_node(0, d) / "metrics.jsonl"
    _wait_until(lambda: metrics.exists() and metrics.read_text().strip(), run, "step 1")
    two_nodes.link(1, up=False)  # mid-step 2
    gone = time.time()
    try:
        rcs = run.wait(timeout_s + 60)
    finally:
        two_nodes.link(1, up=True)
    stopped = time.time() - gone
    assert rcs[0] != 0 and rcs[1] != 0, run.tail()
    for me, other in ((0, 1), (1, 0)):
        assert (f"dsrl: a collective on rank {me} on host {two_nodes.hosts[me]} ({two_nodes.addrs[me]}) failed at "
                in run.text(me)), run.tail()
        assert (f"waiting for another rank (one of: rank {other} on host {two_nodes.hosts[other]} "
                f"({two_nodes.addrs[other]})): " in run.text(me)), run.tail()
    assert f"Timed out waiting {timeout_s * 1000}ms" in run.text(0)
    assert timeout_s <= stopped < timeout_s + 30, stopped
    assert two_nodes.wait_empty(30) == [[], []]
    print(f"host vanished: both nodes stopped {stopped:.1f} s later (trainer.dist_timeout_s={timeout_s})")


SBATCH = ROOT / "launch" / "slurm_example.sbatch"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
# Processes of the cluster itself, left running by a job: SLURM's daemons, munge, the sshds' listeners.
DAEMONS = (b"slurmd", b"slurmctld", b"slurmscriptd", b"munged", b"[listener]")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _kill(pids) -> None:
    """SIGKILL each of `pids` (one already gone is no error)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _job_processes(two_nodes) -> list:
    """[pids of node 0, of node 1] other than the cluster's daemons."""
    return [[p for p in two_nodes.pids(n) if not any(d in _cmdline(p).split(b"\0")[0] for d in DAEMONS)]
            for n in (0, 1)]


def test_slurm_job_ray_on_both_hosts_ssh_launch_both_ranks_and_a_lost_ray_host_named(
        two_nodes, tiny_model_path, tmp_path):
    """launch/slurm_example.sbatch submitted as a user does (`sbatch --nodes=2 ...` on host 0) to a
    SLURM cluster of the two hosts (launch/netns_two_nodes.sh slurm: slurmctld and munged on host 0,
    a slurmd on each): srun steps start a Ray head and worker (launch/ray_cluster.sh --block), the
    job waits for both, scontrol's host names make the hostfile, and multinode_deepspeed.sh starts
    a trainer rank on each host through pdsh/ssh (an sshd on each host); two Ray-placed vLLM engines,
    one per host, serve both ranks. Two steps are checked (one run folder, both ranks' metrics,
    node-local checkpoints, both engines serving); then host 1's Ray processes are SIGKILLed (its
    Ray node dies): both ranks stop naming the engine and its host, the job ends FAILED with the
    trainer's status, and nothing but the cluster's daemons is left on either host."""
    missing = [tool for tool in ("sshd", "pdsh", "ssh-keygen", *SLURM_TOOLS) if not shutil.which(tool, path=SSH_PATH)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found (apt-get install openssh-server pdsh slurmctld slurmd "
                    "slurm-client munge; .ci/run does so as root): the SLURM, ssh and two-host Ray test skipped")
    try:
        for cmd in ("sshd", "slurm"):
            r = subprocess.run([str(SCRIPT_NETNS), cmd, two_nodes.name], capture_output=True, text=True, timeout=60,
                               env=subprocess_env(PATH=SSH_PATH))
            assert r.returncode == 0, (cmd, r.stderr)
        _slurm_job(two_nodes, tmp_path)
    finally:  # the daemons and whatever a failed job left: no process on the nodes for later tests
        _kill([*two_nodes.pids(0), *two_nodes.pids(1)])
        assert two_nodes.wait_empty(30) == [[], []]


def _slurm_job(two_nodes, tmp_path) -> None:
    run_dir = two_nodes.local / "slurm-run"
    job_out = two_nodes.local / "slurm-job.out"
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1",
                         PATH=SSH_PATH, TRAIN_NODES="2", GPUS_PER_NODE="1", RUN_DIR=str(run_dir),
                         MASTER_PORT=str(next(_ports)),
                         RAY_TEMP_DIR=str(two_nodes.local / "ray"), RAY_NUM_CPUS="2",  # 2 per host, 2 per engine
                         # With the suite's other worker busy on the same 2 cores, a raylet missed Ray's default
                         # 5 health checks mid-run in a clean-clone run; 20 tolerate the load (the SIGKILL below
                         # is found through the engine's calls).
                         RAY_health_check_failure_threshold="20")
    env.pop("SLURM_CONF", None)
    argv = ["sbatch", "--wait", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
            f"--output={job_out}", SBATCH, *COMMON, "rollout.backend=vllm", "rollout.num_engines=2",
            "rollout.cpus_per_engine=2", "rollout.timeout_s=120", "trainer.total_steps=4"]
    started = time.time()
    log = tmp_path / "sbatch.log"
    with open(log, "w") as f:
        sbatch = two_nodes.popen(0, argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    out = two_nodes.on_node(0, job_out)
    metrics = two_nodes.on_node(0, run_dir) / "metrics.jsonl"

    def text() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    def tail() -> str:
        return f"--- sbatch:\n{log.read_text()[-2000:]}\n--- job output:\n{text()[-6000:]}"

    # Two steps done: both nodes' step-2 checkpoints complete (metrics are logged before the save).
    saved = [two_nodes.on_node(n, run_dir) / "checkpoints" / "step-000002" / "COMPLETE.json" for n in (0, 1)]
    end, cluster_s = time.time() + 400, None
    while not all(f.exists() for f in saved):
        assert time.time() < end and sbatch.poll() is None, tail()
        if cluster_s is None and "2 nodes up" in text():
            cluster_s = time.time() - started
        time.sleep(0.1)
    two_steps_s = time.time() - started
    job_id = log.read_text().split()[0]
    assert job_id.isdigit(), tail()

    # Two steps: the ranks on both hosts through ssh, one run folder, an engine on each host.
    job = text()
    hosts = " ".join(two_nodes.hosts)
    assert f"ray cluster at {two_nodes.addrs[0]}:6379: 2 nodes up" in job, tail()
    assert f"trainer ranks on: {hosts} | master {two_nodes.addrs[0]}:" in job, tail()
    assert f"{two_nodes.hosts[1]}: " in job  # rank 1's output, through pdsh from host 1
    _check_run_folder(two_nodes, run_dir, job, steps=(1, 2))
    up = re.search(r"rollout engines up: engine-(\d) on ([0-9.]+) .*; engine-(\d) on ([0-9.]+) ", job)
    assert up and {up.group(2), up.group(4)} == set(two_nodes.addrs), tail()  # one engine on each host
    worker = int(up.group(1) if up.group(2) == two_nodes.addrs[1] else up.group(3))
    for row in E2E.metric_rows(two_nodes.on_node(0, run_dir))[:2]:
        assert row["rollout/engine0_prompts"] > 0 and row["rollout/engine1_prompts"] > 0, row
        assert row.get("rollout/sync_logprob_diff", 0.0) < 1e-4  # weights pushed through the object store reached both hosts

    # Host 1's Ray node dies (its `ray start --block` step, raylet, workers, engine); the trainer
    # rank there, its ssh session and slurmd stay.
    ray_pids = [p for p in two_nodes.pids(1) if b"ray" in _cmdline(p) and b"dsrl.main" not in _cmdline(p)]
    assert ray_pids, [_cmdline(p) for p in two_nodes.pids(1)]
    _kill(ray_pids)
    killed = time.time()
    # The job's end, from the controller: `sbatch --wait` polls it at growing intervals (it returned
    # ~26 s after the job had ended, measured), so the test asks scontrol itself.
    state, end, exited = "", time.time() + 240, None
    while time.time() < end:
        state = subprocess.run([str(SCRIPT_NETNS), "exec", two_nodes.name, "0", "scontrol", "show", "job", job_id],
                               capture_output=True, text=True, timeout=60).stdout
        # read after the state: the script's last line precedes its job's end, so it is seen by the
        # time the end is
        if exited is None and "trainer exit status" in text():
            exited = time.time()
        if re.search(r"JobState=(FAILED|COMPLETED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)\b", state):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the SLURM job still ran 240 s after host 1's Ray node was killed:\n{state}\n{tail()}")
    noticed = time.time() - killed
    # The job's batch script ended; its Ray steps stop at once (no 30 s drain on SIGTERM:
    # launch/ray_cluster.sh), so the job leaves COMPLETING within seconds (measured 0.7-3 s; ~30 s
    # with Ray's drain).
    assert exited is not None, tail()
    completing = time.time() - exited
    assert completing < 20, (completing, state)
    sbatch.terminate()  # its wait is over (the job's exit code is checked through scontrol below)
    sbatch.wait(timeout=30)
    job = text()
    status = re.search(r"dsrl job (\d+): trainer exit status (\d+), run dir (\S+)", job)
    assert status and status.group(1) == job_id and status.group(2) != "0" and status.group(3) == str(run_dir), tail()
    pattern = (rf"RolloutEngineError: (vLLM engine {worker} \(Ray actor 'engine-{worker}' in namespace '[^']+', node "
               rf"{re.escape(two_nodes.addrs[1])} / {re.escape(two_nodes.hosts[1])}, pid \d+\): died during \w+)")
    named = re.search(pattern, job)
    assert named, tail()
    job_state = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", state, re.S)
    assert job_state and job_state.groups() == ("FAILED", f"{status.group(2)}:0"), state
    left = [[], []]
    for _ in range(150):  # the Ray head, the ranks, their launchers and sessions: all gone
        left = _job_processes(two_nodes)
        if left == [[], []]:
            break
        time.sleep(0.2)
    assert left == [[], []], [[_cmdline(p) for p in pids] for pids in left]
    print(f"SLURM job {job_id} on two hosts (Ray through srun, ranks through ssh): Ray cluster up {cluster_s:.1f} s, "
          f"2 steps and their checkpoints {two_steps_s:.1f} s; "
          f"host 1's Ray node killed, the job ended {noticed:.1f} s later ({completing:.1f} s completing) (FAILED, exit {status.group(2)}): "
          f"{named.group(1)}")
