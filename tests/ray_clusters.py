"""A Ray cluster simulated on this machine for the tests of nodes that join and leave (`ray.cluster_utils.Cluster`:
real raylets), run by a helper script in a process of its own: a head without CPUs that the driver joins (every
port free), `workers` nodes of one CPU, then commands on stdin, one JSON answer each:

- ``add CPUS``: a worker node joins (`{"added": NODE_ID}`);
- ``remove NODE_ID``: it leaves with notice, its raylet told to stop (`{"removed": ...}`);
- ``kill NODE_ID``: every process of it is killed (`{"killed": ...}`);
- ``shutdown``: the cluster goes (`{"down": true}`).

Its first answer is the cluster's address, its head's id and its worker nodes' ids (`SimulatedCluster.info`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HELPER = r"""
import json, socket, sys
from ray.cluster_utils import Cluster

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 0, "include_dashboard": False, "dashboard_port": free_port(),
    "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
    "runtime_env_agent_port": free_port(), "ray_client_server_port": free_port()})
try:
    workers = [cluster.add_node(num_cpus=1) for _ in range(int(sys.argv[1]))]
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id,
                      "workers": [n.node_id for n in workers]}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["add"]:
            n = cluster.add_node(num_cpus=float(cmd[1]))
            print(json.dumps({"added": n.node_id}), flush=True)
        elif cmd[:1] in (["remove"], ["kill"]):
            n = next(n for n in cluster.worker_nodes if n.node_id == cmd[1])
            cluster.remove_node(n, allow_graceful=cmd[0] == "remove")
            print(json.dumps({"removed" if cmd[0] == "remove" else "killed": cmd[1]}), flush=True)
        elif cmd[:1] == ["shutdown"]:
            break
finally:
    cluster.shutdown()
print(json.dumps({"down": True}), flush=True)
"""


class SimulatedCluster:
    """The helper process and its cluster; every Ray process of it shares the helper's process group, which
    `shutdown` ends whatever state the cluster is in."""

    def __init__(self, env: dict, log: Path, workers: int = 1):
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", HELPER, str(workers)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                         start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.info = self.answer(timeout=180)

    def answer(self, timeout: float = 120) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            pytest.fail(f"the cluster helper did not answer:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def shutdown(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("shutdown\n")
                self.proc.stdin.flush()
                self.proc.wait(90)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
