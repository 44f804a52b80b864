"""The cluster and the actor pool (issues 26 and 29): a request no node can meet is refused before anything is written
(exit 2, naming the field and what the cluster has), or waited for while an autoscaler may add a node, for a stated
time; `resources.actors` takes a number or a `{min, max}` range, and a node that joins mid-run gets actors and work
while a node that leaves loses only its batches in flight (`pipeline.cluster`, `pipeline.job.actor_pool`).

The fast tests drive `pipeline.cluster.check_room` with the nodes, the autoscaler and the clock given. The slow ones
start Rays of their own, never the session's (`ray_session`): `winnow generate` starting a local Ray on this machine
(no GPU, 2 CPUs); a `ray.cluster_utils.Cluster` in a helper process (real raylets on this machine) that adds and
removes nodes on command; and Ray's own autoscaler on a simulated cluster (`ray start --head --autoscaling-config` with
its `fake_multinode` provider, which starts real raylets here as the autoscaler asks). Each has a private RAY_TMPDIR
(no other Ray client on the machine finds it) and its own process group, which the test kills at the end.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import ROOT, job_config, winnow, write_config
from pipeline import cluster
from pipeline.cluster import Autoscaler, Node, NodeGroup, check_room
from pipeline.faults import inflight_records
from runfolder.folder import RunFolder
from tests.ray_clusters import SimulatedCluster
from schemas.base import InputError
from schemas.config import ConfigError, validate_config

# ---------------------------------------------------------------------------------------------------------------
# resources.actors: a number or a range


def test_actors_is_a_number_or_a_range_and_old_configs_hash_as_before(tmp_path):
    pinned = {"name": "pinned", "data": {"source": "builtin:demo-prompts", "id_column": "id"},
              "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
              "method": {"name": "best_of_n", "n": 4}, "output": {"path": "/runs/pinned"},
              "resources": {"actors": 3, "cpus_per_actor": 2, "prompts_per_call": 2}}
    fixed = validate_config(pinned)
    assert fixed.hash() == "4630ff0fc26728ae"  # what the release before the range hashed this config to
    assert fixed.resources.pool == (3, 3)
    old_names = {"workers": 3, "cpus_per_worker": 2, "prompts_per_batch": 2}  # as the release before wrote them
    assert validate_config({**pinned, "resources": old_names}).hash() == "4630ff0fc26728ae"
    assert validate_config({**pinned, "resources": {"actors": 3, "cpus_per_actor": 2, "prompts_per_call": 2,
                                                    "wait_for_nodes_s": 600}}).hash() == "4630ff0fc26728ae"
    ranged = validate_config({**pinned, "resources": {"actors": {"min": 2, "max": 5}}})
    assert ranged.resources.pool == (2, 5) and ranged.hash() != fixed.hash()
    assert ranged.model_dump(mode="json")["resources"]["actors"] == {"min": 2, "max": 5}
    assert validate_config(ranged.model_dump(mode="json")).hash() == ranged.hash()  # the manifest's config resumes


@pytest.mark.parametrize("actors, problem", [
    (0, "resources.actors: Input should be greater than or equal to 1 (got 0)"),
    ("four", "resources.actors: Input should be a valid integer, unable to parse string as an integer (got 'four')"),
    ({"min": 0, "max": 2}, "resources.actors.min: Input should be greater than or equal to 1 (got 0)"),
    ({"min": 3, "max": 2}, "resources.actors.max: 2 is below resources.actors.min (3)"),
    ({"min": 1}, "resources.actors.max: required field is missing"),
    ({"min": 1, "max": 2, "most": 3}, "resources.actors.most: unknown key"),
])
def test_a_bad_actors_value_is_named(tmp_path, actors, problem):
    with pytest.raises(ConfigError) as err:
        validate_config(job_config(tmp_path, resources={"actors": actors}))
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_the_actor_pool_follows_actors_and_the_prompts_are_read_in_blocks_of_a_few_calls(tmp_path):
    from pipeline.job import MAX_BLOCKS, actor_pool, read_blocks

    fixed = actor_pool(validate_config(job_config(tmp_path, resources={"actors": 3})))
    assert (fixed.min_size, fixed.max_size) == (3, 3)
    elastic = actor_pool(validate_config(job_config(tmp_path, resources={"actors": {"min": 1, "max": 4},
                                                                         "feed_calls": True})))
    assert (elastic.min_size, elastic.max_size, elastic.max_concurrent_calls_per_actor) == (1, 4, 2)
    # a block is what one actor is handed at a time, and what one write task commits: about one call, so that every
    # actor (and a node that joins) has work and a call's rows are committed when it ends
    assert [read_blocks(n, 2) for n in (1, 7, 8, 9, 160, 5000)] == [1, 3, 4, 4, 80, 2500]
    assert [read_blocks(n, 64) for n in (16, 200, 5000)] == [1, 3, 78]
    assert read_blocks(2_000_000, 4) == MAX_BLOCKS


# ---------------------------------------------------------------------------------------------------------------
# check_room, with the cluster given


def config(tmp_path, **resources):
    return validate_config(job_config(tmp_path, resources={"actors": 1, **resources}))


def node(cpus: float, gpus: float = 0, name: str = "n") -> Node:
    res = {"CPU": cpus, "memory": 8e9}
    if gpus:
        res["GPU"] = gpus
    return Node(name, "192.0.2.9", res)


class Clock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def requests(monkeypatch):
    """What check_room asks the autoscaler for (None: the request withdrawn)."""
    asked: list = []
    monkeypatch.setattr(cluster, "_request", asked.append)
    return asked


def test_a_node_that_holds_an_actor_is_enough_and_fewer_than_asked_for_is_said(tmp_path, requests):
    lines: list[str] = []
    room = check_room(config(tmp_path, actors=3), lines.append, nodes=lambda: [node(2), node(0.5)],
                      autoscaler=lambda: pytest.fail("not asked when a node holds an actor"))
    assert room.actors == 2 and requests == []
    assert lines == ["the cluster's nodes hold 2 of the 3 actor(s) resources.actors starts with (1 node of 2 CPUs, "
                     "0 GPUs; 1 node of 0.5 CPUs, 0 GPUs): Ray Data runs those, and the others start as nodes with "
                     "room join"]
    lines.clear()
    assert check_room(config(tmp_path, actors={"min": 2, "max": 8}), lines.append,
                      nodes=lambda: [node(1), node(1)]).actors == 2 and lines == []
    assert check_room(config(tmp_path, cpus_per_actor=0.1), lines.append,  # 3 x 0.1 CPUs fit 0.3, to Ray's decimals
                      nodes=lambda: [node(0.3)]).actors == 3


def test_no_node_and_no_autoscaler_is_refused_at_once_naming_each_field(tmp_path, requests):
    with pytest.raises(InputError) as err:
        check_room(config(tmp_path, gpus_per_actor=1, cpus_per_actor=4), nodes=lambda: [node(2), node(2)],
                   autoscaler=lambda: None, sleep=lambda s: pytest.fail("no wait without an autoscaler"))
    assert err.value.problems == [
        "resources.cpus_per_actor: one actor asks for 4 CPUs on one node, but the largest node has 2 CPUs (the "
        "cluster: 2 nodes of 2 CPUs, 0 GPUs), and the cluster has no autoscaler to add one",
        "resources.gpus_per_actor: one actor asks for 1 GPU on one node (0 runs on CPU), but no node of the cluster "
        "has a GPU (the cluster: 2 nodes of 2 CPUs, 0 GPUs), and the cluster has no autoscaler to add one",
    ]
    with pytest.raises(InputError) as err:  # enough of each, but not on one node
        check_room(config(tmp_path, gpus_per_actor=1, cpus_per_actor=4), nodes=lambda: [node(8), node(2, 1)],
                   autoscaler=lambda: None)
    assert err.value.problems == [
        "resources.cpus_per_actor and resources.gpus_per_actor: one actor asks for 4 CPUs and 1 GPU on one node, "
        "but no node has them all (the cluster: 1 node of 8 CPUs, 0 GPUs; 1 node of 2 CPUs, 1 GPU), and the cluster "
        "has no autoscaler to add one"]
    assert requests == []


def test_an_autoscaler_whose_node_types_cannot_hold_an_actor_is_not_waited_for(tmp_path, requests):
    scaler = Autoscaler("~/ray_bootstrap_config.yaml (aws provider)",
                        (NodeGroup("gpu_worker", {"CPU": 4.0, "GPU": 1.0}, 4),))
    with pytest.raises(InputError) as err:
        check_room(config(tmp_path, gpus_per_actor=2), nodes=lambda: [node(4)], autoscaler=lambda: scaler,
                   sleep=lambda s: pytest.fail("no wait for node types that cannot hold an actor"))
    assert err.value.problems == [
        "resources.gpus_per_actor: one actor asks for 2 GPUs on one node (0 runs on CPU), but no node of the cluster "
        "has a GPU (the cluster: 1 node of 4 CPUs, 0 GPUs), and no node type its autoscaler can add has that "
        "(~/ray_bootstrap_config.yaml (aws provider): gpu_worker: 4 CPUs, 1 GPU)"]
    assert requests == []


def test_the_autoscaler_is_waited_for_the_stated_time_then_given_up(tmp_path, requests):
    clock, lines = Clock(), []
    scaler = Autoscaler("the autoscaler's report in Ray's GCS (node types ray.head.default)")
    with pytest.raises(InputError) as err:
        check_room(config(tmp_path, gpus_per_actor=1, wait_for_nodes_s=30), lines.append, nodes=lambda: [node(2)],
                   autoscaler=lambda: scaler, sleep=clock.sleep, clock=lambda: clock.now)
    assert lines == ["no node of the cluster holds an actor (1 CPU, 1 GPU) yet: waiting up to 30 s "
                     "(resources.wait_for_nodes_s) for the autoscaler (the autoscaler's report in Ray's GCS (node "
                     "types ray.head.default)) to add one"]
    assert err.value.problems == [
        "resources.gpus_per_actor: one actor asks for 1 GPU on one node (0 runs on CPU), but no node of the cluster "
        "has a GPU (the cluster: 1 node of 2 CPUs, 0 GPUs), and the autoscaler (the autoscaler's report in Ray's GCS "
        "(node types ray.head.default)) added no node that holds one within resources.wait_for_nodes_s (30 s); see "
        "`ray status` for its node types and limits"]
    assert clock.now == 30 and max(clock.sleeps) <= cluster.POLL_S
    assert requests == [{"CPU": 1.0, "GPU": 1.0}, None]  # asked for one actor's node, and the request withdrawn


def test_a_node_the_autoscaler_adds_in_time_ends_the_wait(tmp_path, requests):
    clock, lines = Clock(), []
    views = iter([[node(0)], [node(0)], [node(0), node(1, name="new")]])
    room = check_room(config(tmp_path, actors={"min": 1, "max": 2}), lines.append, nodes=lambda: next(views),
                      autoscaler=lambda: Autoscaler("x", (NodeGroup("cpu", None, -1),)), sleep=clock.sleep,
                      clock=lambda: clock.now)
    assert (room.actors, room.waited_s) == (1, cluster.POLL_S)  # seen at the second look of the wait
    assert lines[-1] == f"a node that holds an actor joined after {cluster.POLL_S:.0f} s"
    assert requests == [{"CPU": 1.0}, None]


def test_a_cluster_that_cannot_be_read_is_not_checked(tmp_path, requests):
    lines: list[str] = []

    def broken():
        raise ConnectionError("GCS unreachable")

    assert check_room(config(tmp_path), lines.append, nodes=broken).actors == -1
    assert lines == ["the cluster's nodes could not be read (ConnectionError: GCS unreachable); going on without "
                     "checking that one holds an actor"]


# ---------------------------------------------------------------------------------------------------------------
# How an autoscaler is found


def test_the_cluster_launchers_config_on_the_head_names_an_autoscaler_and_its_node_types(tmp_path, monkeypatch):
    shipped = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    found = cluster.autoscaler_of_launcher_config(shipped)
    assert found == Autoscaler("~/ray_bootstrap_config.yaml (aws provider)", (NodeGroup("gpu_worker", None, 4),))
    booted = {**shipped, "available_node_types": {**shipped["available_node_types"], "gpu_worker": {
        **shipped["available_node_types"]["gpu_worker"], "resources": {"CPU": 4, "GPU": 1, "memory": 1.2e10}}}}
    assert cluster.autoscaler_of_launcher_config(booted).groups == (
        NodeGroup("gpu_worker", {"CPU": 4.0, "GPU": 1.0, "memory": 1.2e10}, 4),)
    assert cluster.autoscaler_of_launcher_config({**shipped, "max_workers": 0}) is None
    assert cluster.autoscaler_of_launcher_config({**shipped, "provider": {"type": "readonly"}}) is None
    assert cluster.autoscaler_of_launcher_config("not a mapping") is None
    # find_autoscaler reads it from the driver's home, as `ray up` leaves it on the head
    (tmp_path / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(booted))
    got = cluster.find_autoscaler(str(tmp_path / "ray_bootstrap_config.yaml"))
    assert got is not None and got.groups == cluster.autoscaler_of_launcher_config(booted).groups
    assert cluster.find_autoscaler(str(tmp_path / "absent.yaml")) is None  # no Ray here, or the session's local one
    # one that launches no workers is the last word, whatever the autoscaler's report in the GCS names
    (tmp_path / "none.yaml").write_text(yaml.safe_dump({**shipped, "max_workers": 0}))
    monkeypatch.setattr(cluster, "_from_monitor_report", lambda: Autoscaler("the report"))
    assert cluster.find_autoscaler(str(tmp_path / "none.yaml")) is None
    assert cluster.find_autoscaler(str(tmp_path / "absent.yaml")) == Autoscaler("the report")


def test_the_gcs_cluster_config_and_the_autoscalers_reports():
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(name="gpu", min_count=0, max_count=4)
    group.resources["CPU"], group.resources["GPU"] = 8, 1
    assert cluster.autoscaler_of_cluster_config(config) == Autoscaler(
        "the cluster config in Ray's GCS", (NodeGroup("gpu", {"CPU": 8.0, "GPU": 1.0}, 4),))
    group.min_count = 4  # a fixed group does not grow: no autoscaler, as Ray Data decides
    assert cluster.autoscaler_of_cluster_config(config) is None

    read_only = {"autoscaler_report": {"active_nodes": {"node_4722a859": 1}, "pending_launches": {},
                                       "node_type_mapping": {"192.0.2.2": "node_4722a859"}, "pending_nodes": [],
                                       "failed_nodes": []}}
    assert cluster.autoscaler_of_monitor_report(read_only) is None
    launcher = {"autoscaler_report": {"active_nodes": {}, "pending_launches": {"cpu_node": 1},
                                      "node_type_mapping": {"ffff00000": "ray.head.default"}}}
    assert cluster.autoscaler_of_monitor_report(launcher) == Autoscaler(
        "the autoscaler's report in Ray's GCS (node types cpu_node, ray.head.default)")
    assert cluster.autoscaler_of_monitor_report({"load_metrics_report": {}}) is None

    def status(*types, launches=()):
        nodes = [SimpleNamespace(ray_node_type_name=t, node_id=t[5:] if t.startswith("node_") else "ab") for t in types]
        return SimpleNamespace(active_nodes=nodes, idle_nodes=[], pending_launches=list(launches), failed_launches=[],
                               pending_nodes=[])

    assert cluster.autoscaler_of_cluster_status(status("node_4722a859")) is None
    assert cluster.autoscaler_of_cluster_status(status("headgroup", "gpu-group")).source == \
        "the autoscaler's report of the cluster (node types gpu-group, headgroup)"


# ---------------------------------------------------------------------------------------------------------------
# Through the CLI, on a local Ray the command starts


def _private_env(tmp: str) -> dict:
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
def test_a_request_no_node_can_meet_exits_2_at_once_naming_the_fields(tmp_path):
    """`gpus_per_actor: 1` on this machine without a GPU, and more CPUs per actor than it has: exit 2 right after Ray
    starts, with both fields and what the cluster has, and no run folder."""
    temp = tempfile.mkdtemp(prefix="wcn", dir="/tmp")
    try:
        cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, resources={"actors": 1, "gpus_per_actor": 1,
                                                                                  "cpus_per_actor": 64}))
        started = time.monotonic()
        proc = winnow("generate", str(cfg), env=_private_env(temp), timeout=180)
        seconds = time.monotonic() - started
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "winnow generate: started a local Ray (" in proc.stdout
    assert "winnow generate: 2 problem(s):\n" in proc.stderr
    assert "  - resources.cpus_per_actor: one actor asks for 64 CPUs on one node, but the largest node has " in \
        proc.stderr
    assert "  - resources.gpus_per_actor: one actor asks for 1 GPU on one node (0 runs on CPU), but no node of the " \
           "cluster has a GPU (the cluster: 1 node of " in proc.stderr
    assert "and the cluster has no autoscaler to add one" in proc.stderr
    assert "Traceback" not in proc.stderr and "may hang" not in proc.stderr
    assert not (tmp_path / "run").exists(), "exit 2 writes nothing"
    assert not list(tmp_path.glob("run.*")), "no staged prompt set either"
    assert seconds < 120, f"refused after {seconds:.0f} s"  # Ray's start-up; the check itself does not wait


# ---------------------------------------------------------------------------------------------------------------
# Nodes that join and leave mid-run (ray.cluster_utils)


PACE_S = 0.5
PACE_FILE = "WINNOW_TEST_PACE_FILE"


def paced_reward(prompts, texts):
    """A `python` reward (`test_cluster_nodes:paced_reward`), deterministic, that takes PACE_S per call and no CPU
    while the file named by $WINNOW_TEST_PACE_FILE exists: batches then last long enough for nodes to join and leave
    around them on a loaded machine, and the baseline run, without the file, is quick."""
    if os.path.exists(os.environ.get(PACE_FILE, "/nonexistent")):
        time.sleep(PACE_S)
    return [(sum(map(ord, t)) % 97) / 97 for t in texts]



def _job(tmp_path: Path, name: str, workers, prompts: Path) -> Path:
    cfg = job_config(tmp_path, data={"source": str(prompts), "limit": None}, method={"name": "best_of_n", "n": 4},
                     models={"reward": {"kind": "python", "function": "test_cluster_nodes:paced_reward"}},
                     generation={"max_new_tokens": 16}, output={"path": str(tmp_path / "runs")},
                     resources={"actors": workers, "prompts_per_call": 1, "max_retries": 2})
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _rows(run: Path) -> dict[str, dict]:
    import pyarrow.dataset as pads

    rows = pads.dataset(str(run / "candidates"), format="parquet").to_table().to_pylist()
    assert collections.Counter(r["prompt_id"] for r in rows).most_common(1)[0][1] == 1, "a prompt written twice"
    return {r["prompt_id"]: r for r in rows}


def _same(row: dict) -> tuple:
    """What must not depend on where and when a prompt ran (not its cost, nor output.path's part in the hash)."""
    keep = ("prompt_id", "error", "best_index", "best_text", "best_reward", "run_name")
    return (tuple(row[k] for k in keep),
            [(c["text"], c["num_tokens"], c["finish_reason"], c["reward"]) for c in row["candidates"]])


@pytest.mark.slow
@pytest.mark.alone
def test_a_node_that_joins_takes_batches_and_one_that_leaves_loses_nothing(tmp_path):
    """One cluster, two runs of one config (`workers: {min: 2, max: 3}`): first on its one worker node (the baseline,
    the second actor waiting for room), then anew in another folder, each call paced by its reward, while a 2-CPU node
    joins (the waiting actor starts there and takes batches) and the first node leaves mid-batch (Ray restarts its
    actor on the new node and retries the batch, `max_retries: 2`). Every prompt once, and the rows equal the
    single-node run's."""
    demo = [json.loads(line) for line in (ROOT / "assets" / "demo-prompts" / "prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:02d}", "prompt": demo[i % len(demo)]["prompt"]}) + "\n"
                               for i in range(48)))
    temp = tempfile.mkdtemp(prefix="wcn", dir="/tmp")
    pace = tmp_path / "pace"  # absent for the baseline: the reward does not wait
    env = {**_private_env(temp), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           PACE_FILE: str(pace)}
    nodes = SimulatedCluster(env, tmp_path / "cluster.log")
    try:
        env = {**env, "RAY_ADDRESS": nodes.info["address"]}
        single = tmp_path / "single"
        single.mkdir()
        base = winnow("generate", str(_job(single, "job", {"min": 2, "max": 3}, prompts)), env=env, timeout=300)
        assert base.returncode == 0, base.stderr[-3000:]
        assert "the cluster's nodes hold 1 of the 2 actor(s) resources.actors starts with" in base.stdout
        baseline = _rows(single / "runs")
        assert len(baseline) == 48

        moved = tmp_path / "moved"
        moved.mkdir()
        pace.touch()
        run = moved / "runs"
        with open(moved / "out", "w") as out, open(moved / "err", "w") as err:
            job = subprocess.Popen([sys.executable, "-m", "jobs.generate", str(_job(moved, "job", {"min": 2, "max": 3},
                                                                                     prompts))],
                                   cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            ran: dict[str, set] = collections.defaultdict(set)
            added = removed = None
            deadline = time.monotonic() + 300
            while job.poll() is None and time.monotonic() < deadline:
                for rec in inflight_records(RunFolder(str(run))):
                    ran[rec["node_id"]].add((rec["pid"], rec["first"]))
                if added is None and ran:
                    added = nodes.ask("add 2")["added"]  # the pool's waiting actor starts there, and room for one more
                elif added is not None and removed is None and ran.get(added):
                    removed = nodes.ask(f"remove {nodes.info['workers'][0]}")["removed"]
                time.sleep(0.05)
            status = job.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(30)
        stderr = (moved / "err").read_text()
        assert status == 0, stderr[-3000:]
        assert added and removed == nodes.info["workers"][0], (added, removed, dict(ran))
        assert ran[added], "the node that joined ran no batch"
        after = {pid_first for pid_first in ran[added]}
        assert len(after) >= 2, f"the new node ran {sorted(after)}"
        got = _rows(run)
        assert sorted(got) == sorted(baseline)  # every prompt exactly once
        assert [_same(got[k]) for k in sorted(got)] == [_same(baseline[k]) for k in sorted(got)]
    finally:
        nodes.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Ray's autoscaler, on a simulated cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPORTED = """
import sys, time
import ray
import ray._private.ray_constants as constants
from ray.experimental.internal_kv import _internal_kv_get

ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.monotonic() + 60
while not _internal_kv_get(constants.DEBUG_AUTOSCALING_STATUS) and time.monotonic() < deadline:
    time.sleep(0.5)
"""


@pytest.fixture
def autoscaling_cluster(tmp_path):
    """A head without CPUs under Ray's autoscaler (version 1), whose `fake_multinode` provider starts a 1-CPU node
    (a real raylet on this machine) when asked, up to 2; its address and environment. The head is `ray start
    --head` in a process group of its own, killed at the end (never `ray stop`, which ends every Ray here)."""
    import ray._private.services as services

    temp = tempfile.mkdtemp(prefix="wca", dir="/tmp")
    port = _free_port()
    address = f"{services.get_node_ip_address()}:{port}"
    config = {
        "cluster_name": "fake", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 1,
        "provider": {"type": "fake_multinode", "gcs_address": address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2}},
        "head_node_type": "ray.head.default", "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": []}
    (tmp_path / "autoscaling.json").write_text(json.dumps(config))
    env = {**_private_env(temp), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "disabled"}
    ports = [f"--{name}={_free_port()}" for name in ("dashboard-port", "dashboard-agent-listen-port",
                                                     "metrics-export-port", "runtime-env-agent-port",
                                                     "ray-client-server-port", "node-manager-port",
                                                     "object-manager-port")]
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                             "--num-cpus=0", f"--autoscaling-config={tmp_path / 'autoscaling.json'}",
                             "--include-dashboard=false", "--disable-usage-stats", *ports],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = head.communicate(timeout=180)
        assert head.returncode == 0, out[-3000:]
        # the autoscaler's first report (what the job finds it by) is written within a second or two of its start
        subprocess.run([sys.executable, "-c", REPORTED, address], env=env, timeout=120, check=True,
                       capture_output=True)
        yield address, {**env, "RAY_ADDRESS": address}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # the head's processes and the nodes its autoscaler started
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.alone
def test_the_job_waits_for_the_autoscaler_and_gives_up_after_the_stated_time(tmp_path, autoscaling_cluster):
    """No node holds an actor: the job says it waits for the autoscaler, which adds a 1-CPU node, and runs; a GPU
    that none of the autoscaler's node types has is given up on after `resources.wait_for_nodes_s` (exit 2, nothing
    written)."""
    _, env = autoscaling_cluster
    gpu = write_config(tmp_path / "gpu.yaml", job_config(
        tmp_path, output={"path": str(tmp_path / "gpu-run")},
        resources={"actors": 1, "gpus_per_actor": 1, "wait_for_nodes_s": 4}))
    started = time.monotonic()
    proc = winnow("generate", str(gpu), env=env, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - started >= 4
    assert "winnow generate: no node of the cluster holds an actor (1 CPU, 1 GPU) yet: waiting up to 4 s " \
           "(resources.wait_for_nodes_s) for the autoscaler (the autoscaler's report in Ray's GCS (node types " \
           "ray.head.default" in proc.stdout
    assert "added no node that holds one within resources.wait_for_nodes_s (4 s)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "gpu-run").exists()

    cpu = write_config(tmp_path / "cpu.yaml", job_config(tmp_path, resources={"actors": 1, "wait_for_nodes_s": 150}))
    proc = winnow("generate", str(cpu), env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "winnow generate: joined the Ray cluster at RAY_ADDRESS=" in proc.stdout
    assert "no node of the cluster holds an actor (1 CPU) yet: waiting up to 150 s" in proc.stdout
    assert "winnow generate: a node that holds an actor joined after " in proc.stdout
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (m["status"], m["rows"]) == ("succeeded", 4)


# -- actors that share a GPU (issue 29) ------------------------------------------------------------------------------

def test_models_that_do_not_fit_an_actors_share_of_a_gpu_are_refused_naming_the_field():
    from pipeline.cluster import share_problems
    from schemas.config import validate_config

    def cfg(share, dtype="auto"):
        return validate_config(job_config(Path("/tmp"), resources={"gpus_per_actor": share},
                                          models={"dtype": dtype}))

    gib = 2**30
    params = {"target": 7 * 10**9, "draft": None, "reward": 10**9}  # 16 GB of 16-bit weights
    assert share_problems(cfg(0.5), 80 * gib, "H100", params) == []  # 36 GiB usable of 40
    assert share_problems(cfg(1), 10 * gib, "L4", params) == []  # a whole device: the engines size themselves
    assert share_problems(cfg(0.25), 80 * gib, "H100", params) == []  # 14.9 GiB of 16-bit weights in 18 GiB
    problems = share_problems(cfg(0.25, "float32"), 80 * gib, "H100", params)  # 32 GB of float32 weights
    assert problems == ["resources.gpus_per_actor: 0.25 of a GPU (H100, 80.0 GiB) gives an actor 18.0 GiB, and the "
                        "models' weights alone take 29.8 GiB (target 26.1 GiB, reward 3.7 GiB, 4 bytes a parameter); "
                        "give each actor at least 0.41 of a GPU, or smaller models"]


def test_check_share_reads_the_gpu_through_a_probe_and_refuses_models_that_do_not_fit(tmp_path):
    from schemas.base import InputError
    from schemas.config import validate_config

    config = validate_config(job_config(tmp_path, resources={"gpus_per_actor": 0.25}))
    said = []
    cluster.check_share(config, log=said.append, probe=lambda share: (2**30, "tiny GPU"),
                        count=lambda location: 0)  # nothing counted: fits
    with pytest.raises(InputError, match=r"0.25 of a GPU \(tiny GPU, 1.0 GiB\) gives an actor 0.2 GiB"):
        cluster.check_share(config, log=said.append, probe=lambda share: (2**30, "tiny GPU"),
                            count=lambda location: 10**9)
    cluster.check_share(config, log=said.append, probe=lambda share: None)  # no GPU answered: said, run goes on
    assert said and "could not be read" in said[-1]


def test_actors_that_share_a_gpu_are_packed_on_one_device(tmp_path, requests):
    """gpus_per_actor 0.25: a node of one GPU (and the CPUs) holds four actors; one of half a GPU holds two."""
    room = check_room(config(tmp_path, actors=4, gpus_per_actor=0.25, cpus_per_actor=1), lambda line: None,
                      nodes=lambda: [node(4, gpus=1)], autoscaler=lambda: None)
    assert room.actors == 4
    room = check_room(config(tmp_path, actors=4, gpus_per_actor=0.25, cpus_per_actor=1), lambda line: None,
                      nodes=lambda: [node(8, gpus=0.5)], autoscaler=lambda: None)
    assert room.actors == 2
