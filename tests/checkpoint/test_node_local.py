"""trainer.checkpoint_storage=node_local with two real gloo ranks, each "node" (LOCAL_RANK 0 both) on
its own folder: the folder check passes there and refuses one folder both see; a resume takes the
newest step complete on every node, naming the one a node lacks; the shared state comes from rank
0 (only its node has it). The two-host end-to-end runs are in tests/multinode."""
import json
import os

from two_ranks import run_two_ranks


def _complete(run: str, step: int, files: dict) -> None:
    folder = os.path.join(run, "checkpoints", f"step-{step:06d}")
    os.makedirs(folder)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "COMPLETE.json"), "w") as f:
        json.dump({name: len(text) for name, text in files.items()}, f)


def _run(tmp_path, roots, job="check"):
    return run_two_ranks(tmp_path, roots, "node_local", job)


def test_node_local_folders_pass_and_one_shared_folder_is_refused(tmp_path):
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    assert _run(tmp_path, [node0, node1]) == ["ok", "ok"]
    assert os.listdir(node0 / "checkpoints") == [] and os.listdir(node1 / "checkpoints") == []
    shared = tmp_path / "shared" / "run"
    for msg in _run(tmp_path, [shared, shared]):
        assert msg.startswith("trainer.checkpoint_storage=node_local: rank 0 on ")
        assert "sees 2 node writers' folders (ranks 0, 1)" in msg and "use trainer.checkpoint_storage=shared" in msg


def test_resume_takes_the_newest_step_complete_on_every_node_and_rank0s_shared_state(tmp_path):
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    state = json.dumps({"step": 2, "world_size": 2})
    _complete(str(node0), 2, {"rank-0.pt": "a", "trainer_state.json": state})
    _complete(str(node1), 2, {"rank-1.pt": "b"})
    _complete(str(node0), 3, {"rank-0.pt": "a", "trainer_state.json": state})  # node 1 died before its rename
    got = [json.loads(r) for r in _run(tmp_path, [node0, node1], job="find")]
    assert [g["found"] for g in got] == [str(n / "checkpoints" / "step-000002") for n in (node0, node1)]
    assert got[0]["state"] == got[1]["state"] == {"step": 2, "world_size": 2}
    assert any("skipping checkpoint" in w and "step-000003: not complete on every node (rank 1 on" in w
               for w in got[0]["warnings"]), got[0]["warnings"]
