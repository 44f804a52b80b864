"""Whether the Ray cluster can hold the job's actors, asked after `pipeline.job.connect` and before anything is
written (`check_room`).

An actor asks Ray for `resources.cpus_per_actor` CPUs and `resources.gpus_per_actor` GPUs, all on one node. Ray
never refuses a request that no node can meet: it waits for one, and Ray Data only warns that the job "may hang
forever". So `check_room` compares the request with the total resources of every alive node (`ray.nodes()`), before
the prompts are staged or the run folder is touched:

- **A node holds an actor.** The run goes on. Where the nodes hold fewer actors than the pool starts with
  (`resources.actors`, or its `min`), it says so: Ray Data runs the actors that fit, and the others start when a
  node with room joins (a pool of `actors: 3` on one 2-CPU node runs 2 actors and finishes).
- **No node holds one, and no autoscaler can add one.** `InputError` (exit 2), naming the field, what one actor
  asks for and what the nodes have (`gpus_per_actor: 1` on a machine without a GPU).
- **No node holds one, but an autoscaler may add one.** It says it waits for the autoscaler, asks the autoscaler for
  a node that holds one actor (`ray.autoscaler.sdk.request_resources`, withdrawn when the wait ends, whatever its
  end), and waits up to `resources.wait_for_nodes_s` seconds for such a node to join; then it gives up (exit 2,
  saying how long it waited). Where the autoscaler's own config says what its node types hold and none of them holds
  an actor, it does not wait: exit 2 at once, naming the node types. The request is the cluster's one standing
  request (`request_resources` replaces the last one; Ray Data's own coordinator sends its own every 20 s while a
  pipeline runs); a driver killed while it waits leaves it standing until the next request replaces it.

How an autoscaler is found (`find_autoscaler`), first match wins; a source that cannot be read is skipped:

1. The cluster config in Ray's GCS (`ray._private.state.state.get_cluster_config()`): its node groups, with their
   resources and counts, as the autoscaler reports them. Ray Data and Ray Train read the same; a group that may
   grow (``max_count`` -1 or above ``min_count``) makes it an autoscaler, as Ray Data decides.
2. ``~/ray_bootstrap_config.yaml`` on the driver's machine: the cluster launcher's config that `ray up` puts on the
   head, where `ray job submit` runs the driver (Ray's usage statistics read it there too). A provider other than
   ``readonly`` with room for workers (``max_workers``) makes it an autoscaler; its ``available_node_types`` say
   what each node type holds where they list ``resources`` (the launcher fills them in for AWS instance types). A
   launcher config that launches no workers ends the search: no autoscaler.
3. The autoscaler's report that Ray keeps in the GCS for `ray status` (version 1, the default): a cluster without an
   autoscaler is watched by Ray's read-only provider, which names each node's type ``node_<node id>``; node types
   named otherwise (the head's ``ray.head.default`` included), or launches pending or failed, come from a provider
   that launches nodes. What those node types hold is not said there: the wait decides.
4. The same from autoscaler version 2 (`ray.autoscaler.v2.sdk.get_cluster_status`), where the cluster runs it.

`tests/test_cluster_nodes.py` runs the whole wait against Ray's own autoscaler on a simulated cluster (its
``fake_multinode`` provider starts real raylets on this machine), found by source 3.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from schemas.base import InputError
from schemas.config import JobConfig, ResourcesConfig

# The config fields of the resources an actor asks for
FIELDS = {"CPU": "resources.cpus_per_actor", "GPU": "resources.gpus_per_actor"}
POLL_S = 2.0  # between two looks at the nodes while waiting for the autoscaler
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` puts the cluster launcher's config on the head
_SLACK = 1e-6  # Ray keeps resource amounts to 4 decimals: 0.1 + 0.2 CPUs fit a node of 0.3
READ_ONLY_TYPE = re.compile(r"^node_[0-9a-f]+$")  # how Ray's read-only provider names a node's type (its node id)
NONE = object()  # a source that knows there is no autoscaler (a launcher config that launches no workers)


@dataclass(frozen=True)
class Node:
    """An alive node of the cluster and its total resources (what it holds, whoever uses them now)."""

    node_id: str
    address: str
    resources: dict[str, float]


@dataclass(frozen=True)
class NodeGroup:
    """A node type an autoscaler may start: its resources (None where its config does not say) and its most nodes
    (-1: no limit)."""

    name: str
    resources: dict[str, float] | None
    max_count: int


@dataclass(frozen=True)
class Autoscaler:
    """An autoscaler of the cluster: where it was found, and its node types as far as that source tells them."""

    source: str
    groups: tuple[NodeGroup, ...] = ()


@dataclass
class Room:
    """What `check_room` found: the actors the cluster's nodes hold at once (by their totals; -1 where Ray's state API
    did not answer), its alive nodes, and the seconds it waited for the autoscaler (0 when it did not)."""

    actors: int
    nodes: list[Node] = field(default_factory=list)
    waited_s: float = 0.0


# ---------------------------------------------------------------------------------------------------------------
# What an actor asks for, and what holds it


def actor_shape(resources: ResourcesConfig) -> dict[str, float]:
    """The resources one actor asks Ray for, on one node."""
    shape = {"CPU": float(resources.cpus_per_actor)}
    if resources.gpus_per_actor > 0:
        shape["GPU"] = float(resources.gpus_per_actor)
    return shape


def holds(resources: dict[str, float], shape: dict[str, float]) -> int:
    """How many actors of `shape` a node of `resources` (totals) holds at once."""
    counts = [math.floor(resources.get(name, 0.0) / amount + _SLACK) for name, amount in shape.items() if amount > 0]
    return max(0, min(counts)) if counts else 0


# ---------------------------------------------------------------------------------------------------------------
# The cluster as Ray reports it


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes and their total resources (`ray.nodes()`)."""
    import ray

    return [Node(n.get("NodeID", ""), n.get("NodeManagerAddress", ""), dict(n.get("Resources") or {}))
            for n in ray.nodes() if n.get("Alive")]


def find_autoscaler(bootstrap_config: str = BOOTSTRAP_CONFIG) -> Autoscaler | None:
    """The cluster's autoscaler, from the first source that shows one (module docstring), or None. A launcher config
    on the head that launches no workers is the last word: no autoscaler, whatever names its node types carry."""
    sources = (_from_gcs_cluster_config, lambda: _from_bootstrap_config(bootstrap_config), _from_monitor_report,
               _from_cluster_status)
    for source in sources:
        try:
            found = source()
        except Exception:  # noqa: BLE001 - a source that cannot be read tells nothing; the next one may
            found = None
        if found is NONE:
            return None
        if found is not None:
            return found
    return None


def _from_gcs_cluster_config() -> Autoscaler | None:
    import ray._private.state

    config = ray._private.state.state.get_cluster_config()
    if config is None:
        return None
    return autoscaler_of_cluster_config(config)


def autoscaler_of_cluster_config(config) -> Autoscaler | None:
    """An `autoscaler_pb2.ClusterConfig` (node groups with resources, min_count, max_count) as an Autoscaler, or None
    when no group may grow."""
    groups = [g for g in config.node_group_configs if g.max_count != 0]
    if not any(g.max_count == -1 or g.max_count > g.min_count for g in groups if g.resources):
        return None
    return Autoscaler("the cluster config in Ray's GCS",
                      tuple(NodeGroup(g.name, {k: float(v) for k, v in g.resources.items()} or None, g.max_count)
                            for g in groups))


def _from_bootstrap_config(path: str):
    import yaml

    full = os.path.expanduser(path)
    if not os.path.isfile(full) or os.path.getsize(full) > 10_000_000:
        return None
    with open(full) as f:
        config = yaml.safe_load(f)
    found = autoscaler_of_launcher_config(config, path)
    return NONE if found is None and isinstance(config, dict) and "provider" in config else found


def autoscaler_of_launcher_config(config, path: str = BOOTSTRAP_CONFIG) -> Autoscaler | None:
    """A cluster launcher config (`ray up`'s YAML, as bootstrapped on the head) as an Autoscaler, or None when it
    launches no workers (the read-only provider, or ``max_workers: 0`` everywhere)."""
    if not isinstance(config, dict):
        return None
    provider = config.get("provider") if isinstance(config.get("provider"), dict) else {}
    if provider.get("type") in (None, "readonly"):
        return None
    cluster_max = _count(config.get("max_workers"), 2)  # the launcher's default
    types = config.get("available_node_types") if isinstance(config.get("available_node_types"), dict) else {}
    head = config.get("head_node_type")
    groups = []
    for name, spec in types.items():
        spec = spec if isinstance(spec, dict) else {}
        if name == head:
            continue  # the head is up already: it is one of the alive nodes
        most = min(_count(spec.get("max_workers"), cluster_max), cluster_max)
        if most <= 0:
            continue
        res = spec.get("resources")
        resources = ({str(k): float(v) for k, v in res.items() if isinstance(v, (int, float))}
                     if isinstance(res, dict) and res else None)
        groups.append(NodeGroup(str(name), resources, most))
    if cluster_max <= 0 or (types and not groups):
        return None
    return Autoscaler(f"{path} ({provider.get('type')} provider)", tuple(groups))


def _count(value, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _from_monitor_report() -> Autoscaler | None:
    import json

    import ray._private.ray_constants as constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(constants.DEBUG_AUTOSCALING_STATUS)
    return autoscaler_of_monitor_report(json.loads(raw)) if raw else None


def autoscaler_of_monitor_report(status: dict) -> Autoscaler | None:
    """The report Ray's autoscaler (version 1) keeps in the GCS for `ray status` as an Autoscaler, or None where it
    comes from Ray's read-only provider (each node's type is ``node_<its node id>``, and nothing is ever launched)."""
    report = status.get("autoscaler_report") if isinstance(status, dict) else None
    if not isinstance(report, dict):
        return None
    names = {str(t) for t in (report.get("node_type_mapping") or {}).values()}
    names |= {str(t) for t in (report.get("active_nodes") or {})}
    names |= {str(t) for t in (report.get("pending_launches") or {})}
    named = sorted(t for t in names if not READ_ONLY_TYPE.match(t))
    if not named and not report.get("pending_nodes") and not report.get("failed_nodes"):
        return None
    return Autoscaler("the autoscaler's report in Ray's GCS (node types " + ", ".join(named or ["?"]) + ")")


def _from_cluster_status() -> Autoscaler | None:
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if not is_autoscaler_v2(fetch_from_server=True):
        return None
    return autoscaler_of_cluster_status(get_cluster_status(ray.get_runtime_context().gcs_address))


def autoscaler_of_cluster_status(status) -> Autoscaler | None:
    """The report of Ray's autoscaler version 2 (`ray.autoscaler.v2.schema.ClusterStatus`) as an Autoscaler, or None
    where it comes from the read-only provider (node types ``node_<node id>``, nothing launched)."""
    nodes = [*status.active_nodes, *status.idle_nodes]
    named = sorted({n.ray_node_type_name for n in nodes
                    if n.ray_node_type_name and not READ_ONLY_TYPE.match(n.ray_node_type_name)})
    launches = [*status.pending_launches, *status.failed_launches, *status.pending_nodes]
    if not named and not launches:
        return None
    return Autoscaler("the autoscaler's report of the cluster (node types " + ", ".join(named or ["?"]) + ")")


# ---------------------------------------------------------------------------------------------------------------
# The check


def _amount(value: float, unit: str) -> str:
    return f"{value:g} {unit}" + ("" if value == 1 else "s")


def describe_nodes(nodes: list[Node], shape: dict[str, float]) -> str:
    """The nodes by what they hold of the resources an actor asks for, the commonest first, then the largest:
    ``2 nodes of 2 CPUs, 0 GPUs; 1 node of 8 CPUs, 1 GPU``."""
    names = list(dict.fromkeys(["CPU", "GPU", *shape]))
    kinds = Counter(tuple(n.resources.get(r, 0.0) for r in names) for n in nodes)
    parts = [f"{count} node{'s' if count > 1 else ''} of " + ", ".join(_amount(v, r) for v, r in zip(key, names))
             for key, count in sorted(kinds.items(), key=lambda kv: (-kv[1], [-v for v in kv[0]]))]
    return "; ".join(parts) if parts else "no alive node"


def shortfall(shape: dict[str, float], nodes: list[Node]) -> list[str]:
    """Why no node holds one actor, one line per config field: each resource no node has enough of, or, where each
    has a node with enough, that no node has them all."""
    have = describe_nodes(nodes, shape)
    out = []
    for r, amount in shape.items():
        if any(n.resources.get(r, 0.0) + _SLACK >= amount for n in nodes):
            continue
        most = max((n.resources.get(r, 0.0) for n in nodes), default=0.0)
        got = f"the largest node has {_amount(most, r)}" if most > 0 else f"no node of the cluster has a {r}"
        hint = " (0 runs on CPU)" if r == "GPU" else ""
        out.append(f"{FIELDS.get(r, 'resources: ' + r)}: one actor asks for {_amount(amount, r)} on one node{hint}, "
                   f"but {got} (the cluster: {have})")
    if not out:
        fields = " and ".join(FIELDS.get(r, r) for r in shape)
        asks = " and ".join(_amount(a, r) for r, a in shape.items())
        out.append(f"{fields}: one actor asks for {asks} on one node, but no node has them all (the cluster: {have})")
    return out


def check_room(config: JobConfig, log: Callable[[str], None] = print, *,
               nodes: Callable[[], list[Node]] = alive_nodes,
               autoscaler: Callable[[], Autoscaler | None] = find_autoscaler,
               sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> Room:
    """Whether the connected cluster can hold the job's actors (module docstring); InputError (exit 2) where it
    cannot, or where the autoscaler added no node that can within `resources.wait_for_nodes_s`."""
    r = config.resources
    shape = actor_shape(r)
    try:
        alive = nodes()
    except Exception as err:  # noqa: BLE001 - Ray's state API did not answer: the run goes on unchecked
        log(f"the cluster's nodes could not be read ({type(err).__name__}: {err}); going on without checking that "
            "one holds an actor")
        return Room(-1)
    fit = sum(holds(n.resources, shape) for n in alive)
    if fit == 0:
        scaler = autoscaler()
        why = shortfall(shape, alive)
        if scaler is None:
            raise InputError([f"{line}, and the cluster has no autoscaler to add one" for line in why])
        known = [g for g in scaler.groups if g.resources is not None]
        if scaler.groups and len(known) == len(scaler.groups) and not any(holds(g.resources, shape) for g in known):
            types = "; ".join(f"{g.name}: " + ", ".join(_amount(g.resources.get(x, 0.0), x) for x in
                                                        dict.fromkeys(["CPU", "GPU", *shape])) for g in known)
            raise InputError([f"{line}, and no node type its autoscaler can add has that ({scaler.source}: {types})"
                              for line in why])
        fit, alive, waited = _wait_for_a_node(shape, r.wait_for_nodes_s, scaler, why, log, nodes, sleep, clock)
        return _said(Room(fit, alive, waited), r, log)
    return _said(Room(fit, alive), r, log)


# ---------------------------------------------------------------------------------------------------------------
# Actors that share a GPU (resources.gpus_per_actor below 1)

SHARE_USABLE = 0.9  # of an actor's share of a GPU, what its models and caches may fill (vLLM's own default)
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # on a GPU, auto is a 16-bit dtype


def share_problems(config: JobConfig, device_bytes: int, device: str, parameters: dict[str, int | None]) -> list[str]:
    """Why the job's models cannot fit an actor's share of a GPU (resources.gpus_per_actor below 1: Ray packs
    1 / gpus_per_actor actors on a device), or []: their weights alone, at models.dtype on a GPU, must leave room
    in SHARE_USABLE of the share (the engines then size their KV cache to the rest: workers.accounting.memory)."""
    share = config.resources.gpus_per_actor
    if not 0 < share < 1:
        return []
    per = WEIGHT_BYTES[config.models.dtype]
    weights = {role: count * per for role, count in parameters.items() if count}
    room = share * device_bytes * SHARE_USABLE
    need = sum(weights.values())
    if need < room:
        return []
    gib = 2**30
    parts = ", ".join(f"{role} {b / gib:.1f} GiB" for role, b in weights.items())
    least = need / (device_bytes * SHARE_USABLE)
    return [f"resources.gpus_per_actor: {share:g} of a GPU ({device}, {device_bytes / gib:.1f} GiB) gives an actor "
            f"{room / gib:.1f} GiB, and the models' weights alone take {need / gib:.1f} GiB ({parts}, "
            f"{'2 bytes' if per == 2 else '4 bytes'} a parameter); give each actor at least {least:.2f} of a GPU, or "
            "smaller models"]


def probe_gpu(share: float, timeout_s: float = 300.0) -> tuple[int, str] | None:
    """(total memory in bytes, name) of a GPU an actor of `share` would run on, read by a Ray task that asks for the
    same share; None where no such task ran in time or it saw no CUDA device (a cluster that fakes GPUs)."""
    import ray

    @ray.remote(num_gpus=share, num_cpus=0)
    def device() -> tuple[int, str] | None:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), str(props.name)

    ref = device.remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        return None
    return ray.get(ref)


def check_share(config: JobConfig, log: Callable[[str], None] = print, probe: Callable = probe_gpu,
                count: Callable | None = None) -> None:
    """InputError (exit 2) where actors that share a GPU (resources.gpus_per_actor below 1) cannot fit their models
    in their share of the device a probe task reads (`share_problems`); nothing where each actor has a whole GPU or
    none, or where no probe could run (said)."""
    share = config.resources.gpus_per_actor
    if not 0 < share < 1:
        return
    from pipeline.preflight import count_model, resolved
    from runfolder.parameters import job_parameters

    try:
        found = probe(share)
    except Exception as err:  # noqa: BLE001 - a probe that fails says nothing about the models: the run goes on
        found, why = None, f"{type(err).__name__}: {err}"
    else:
        why = "no task on a GPU answered"
    if found is None:
        log(f"the GPU an actor would share could not be read ({why}); going on without checking that the models "
            f"fit {share:g} of it")
        return
    counts = job_parameters(resolved(config), count=count or count_model)
    loaded = {"target": counts.target, "draft": counts.draft if config.draft_needed_by else None,
              "reward": counts.reward}  # the draft is loaded where something needs it (workers.engines.hf)
    problems = share_problems(config, found[0], found[1], loaded)
    if problems:
        raise InputError(problems)


def _said(room: Room, r: ResourcesConfig, log: Callable[[str], None]) -> Room:
    least, _ = r.pool
    if room.actors < least:
        log(f"the cluster's nodes hold {room.actors} of the {least} actor(s) resources.actors starts with "
            f"({describe_nodes(room.nodes, actor_shape(r))}): Ray Data runs those, and the others start as nodes "
            "with room join")
    return room


def _wait_for_a_node(shape, wait_s, scaler, why, log, nodes, sleep, clock) -> tuple[int, list[Node], float]:
    asks = ", ".join(_amount(a, r) for r, a in shape.items())
    log(f"no node of the cluster holds an actor ({asks}) yet: waiting up to {wait_s:g} s "
        f"(resources.wait_for_nodes_s) for the autoscaler ({scaler.source}) to add one")
    start = clock()
    _request(shape)
    try:
        while True:
            alive = nodes()
            fit = sum(holds(n.resources, shape) for n in alive)
            waited = clock() - start
            if fit:
                log(f"a node that holds an actor joined after {waited:.0f} s")
                return fit, alive, waited
            if waited >= wait_s:
                raise InputError([f"{line}, and the autoscaler ({scaler.source}) added no node that holds one "
                                  f"within resources.wait_for_nodes_s ({wait_s:g} s); see `ray status` for its "
                                  "node types and limits" for line in why])
            sleep(min(POLL_S, max(0.0, wait_s - waited)))
    finally:
        _request(None)


def _request(shape: dict[str, float] | None) -> None:
    """Ask the autoscaler for a node that holds one actor (None: withdraw the request). Best effort: the wait is what
    decides."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[shape] if shape else [])
    except Exception:  # noqa: BLE001 - an autoscaler that cannot be asked may still scale on its own
        pass
