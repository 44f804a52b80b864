"""cluster.yaml would give a working cluster, as far as that can be checked offline.

No cloud here: these tests read the file, pass it through Ray's own config preparation and schema, and check what
each node type would run (computed the way the launcher computes it) against what the project needs: an image per
node type, the Ray that pyproject.toml pins (and that these tests run), the CPU build of torch on the head, the
CUDA build on GPU workers, no torchvision/torchaudio/torchcodec anywhere, rsync excludes that keep the local
virtual environment and run outputs off the nodes, and Ray's own start commands and head setup left in place.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
GPU_INSTANCE = re.compile(r"^(g\d|p\d)")  # AWS NVIDIA GPU families: g4dn, g5, g6, g6e, p4d, p5, ...
AMI_ID = re.compile(r"^ami-[0-9a-f]{8}(?:[0-9a-f]{9})?$")
SSM_IMAGE = re.compile(r"^resolve:ssm:/aws/service/\S+$")  # EC2 resolves a public SSM parameter at launch
FORBIDDEN = re.compile(r"\btorch(?:vision|audio|codec)\b")
# pip options that take a value (the value is not a requirement)
PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                     "-r", "--requirement", "-t", "--target", "--prefix", "--root", "--python", "-e", "--editable"}


def _raw() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _ray_util():
    try:
        from ray.autoscaler._private import util
    except ImportError as e:  # pragma: no cover - only when Ray moves it
        pytest.fail(f"ray.autoscaler._private.util is gone from Ray {_ray_version()}: cannot check cluster.yaml ({e})")
    return util


def _ray_version() -> str:
    import ray

    return ray.__version__


def _prepared() -> dict:
    """The config as `ray up` sees it: Ray's AWS defaults filled in, setup_commands merged into the head and worker
    setup commands."""
    return _ray_util().prepare_config(_raw())


def _ray_defaults() -> dict:
    import ray.autoscaler

    path = Path(ray.autoscaler.__file__).parent / "aws" / "defaults.yaml"
    assert path.is_file(), f"Ray {_ray_version()} ships no {path}: cannot compare cluster.yaml with Ray's defaults"
    return yaml.safe_load(path.read_text())


def _effective_setup(prepared: dict, node_type: str) -> list[str]:
    """What the launcher runs to set up a node of this type, as Ray 2.60 decides it: the head runs
    setup_commands + head_setup_commands; a worker runs its node type's own worker_setup_commands when it has them
    (they replace the global setup_commands and worker_setup_commands), else setup_commands + worker_setup_commands.
    initialization_commands run before either."""
    spec = prepared["available_node_types"][node_type]
    init = spec.get("initialization_commands", prepared.get("initialization_commands", []))
    if node_type == prepared["head_node_type"]:
        return [*init, *prepared["head_setup_commands"]]
    return [*init, *spec.get("worker_setup_commands", prepared["worker_setup_commands"])]


@dataclass
class Install:
    requirement: Requirement
    index_url: str | None
    position: int  # index of the command in the node's setup


@dataclass
class Editable:
    path: str
    position: int


def _pip_installs(commands: list[str]) -> tuple[list[Install], list[Editable]]:
    """Requirements and editable paths of every `pip install` (also `python -m pip`, `uv pip`) in the commands."""
    installs: list[Install] = []
    editables: list[Editable] = []
    for position, command in enumerate(commands):
        for segment in re.split(r"&&|\|\||;|\|", command):
            try:
                tokens = shlex.split(segment)
            except ValueError:
                continue
            for i in range(len(tokens) - 1):
                if (tokens[i] in ("pip", "pip3") or tokens[i].endswith("/pip")) and tokens[i + 1] == "install":
                    break
            else:
                continue
            args = tokens[i + 2:]
            index_url = None
            for j, arg in enumerate(args):
                if arg in ("-i", "--index-url") and j + 1 < len(args):
                    index_url = args[j + 1]
                elif arg.startswith("--index-url="):
                    index_url = arg.split("=", 1)[1]
            j = 0
            segment_reqs: list[Requirement] = []
            while j < len(args):
                arg = args[j]
                if arg in ("-e", "--editable") and j + 1 < len(args):
                    editables.append(Editable(args[j + 1], position))
                    j += 2
                    continue
                if arg in PIP_VALUE_OPTIONS:
                    j += 2
                    continue
                if not arg.startswith("-") and "/" not in arg:
                    try:
                        segment_reqs.append(Requirement(arg))
                    except InvalidRequirement:
                        pass
                j += 1
            installs.extend(Install(r, index_url, position) for r in segment_reqs)
    return installs, editables


def _node_types() -> list[str]:
    return list(_raw()["available_node_types"])


def _is_gpu(prepared: dict, node_type: str) -> bool:
    instance = prepared["available_node_types"][node_type]["node_config"].get("InstanceType", "")
    return bool(GPU_INSTANCE.match(instance))


def _pyproject_ray() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    rays = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert len(rays) == 1, f"pyproject.toml should list ray once among the dependencies, found {rays}"
    return rays[0]


def _same(a: Requirement, b: Requirement) -> bool:
    return (a.name, sorted(a.extras), str(a.specifier), a.marker) == (b.name, sorted(b.extras), str(b.specifier), b.marker)


# ---------------------------------------------------------------------------------------------------------- schema


def test_cluster_yaml_passes_rays_own_schema():
    import ray.autoscaler

    schema = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    assert schema.is_file(), f"Ray {_ray_version()} ships no {schema}: the cluster config cannot be validated"
    util = _ray_util()
    assert hasattr(util, "validate_config"), f"Ray {_ray_version()} has no validate_config"
    # prepare_config fills in Ray's AWS defaults and merges the setup commands, as `ray up` does before validating.
    util.validate_config(_prepared())  # raises jsonschema.ValidationError naming the bad key or value


def test_every_bash_command_parses():
    prepared = _prepared()
    for node_type in prepared["available_node_types"]:
        for command in _effective_setup(prepared, node_type):
            done = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{node_type}: bash cannot parse {command!r}: {done.stderr.strip()}"


# ---------------------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("node_type", _node_types())
def test_every_node_type_names_an_image(node_type):
    node_config = _raw()["available_node_types"][node_type]["node_config"]
    image = str(node_config.get("ImageId", "")).strip()
    assert image, (f"{node_type} has no node_config.ImageId: Ray would fall back to its old Deep Learning AMI "
                   "(Ubuntu 18.04, CUDA 11.2)")
    assert image.lower() != "latest_dlami", f"{node_type}: ImageId latest_dlami is Ray's old CUDA 11.2 fallback"
    assert AMI_ID.match(image) or SSM_IMAGE.match(image), (
        f"{node_type}: ImageId {image!r} is neither an AMI id (ami-...) nor resolve:ssm:/aws/service/...")


def test_gpu_workers_use_an_image_with_an_nvidia_driver():
    prepared = _prepared()
    gpu_types = [t for t in prepared["available_node_types"] if _is_gpu(prepared, t)]
    assert gpu_types, "cluster.yaml has no GPU node type (g*/p* instance): the models would have nowhere to run"
    for node_type in gpu_types:
        image = prepared["available_node_types"][node_type]["node_config"]["ImageId"]
        if SSM_IMAGE.match(image):
            assert "/deeplearning/" in image and "nvidia-driver" in image, (
                f"{node_type} is a GPU node but its image parameter {image} is not an AWS Deep Learning AMI with the "
                "NVIDIA driver")


# ---------------------------------------------------------------------------------------------------------- packages


@pytest.mark.parametrize("node_type", _node_types())
def test_every_node_installs_the_ray_pyproject_pins_and_the_tests_run(node_type):
    pin = _pyproject_ray()
    assert [str(s) for s in pin.specifier] == [f"=={_ray_version()}"], (
        f"pyproject.toml pins {pin}, but these tests run Ray {_ray_version()}: the cluster would run an untested Ray")
    prepared = _prepared()
    installs, _ = _pip_installs(_effective_setup(prepared, node_type))
    rays = [i.requirement for i in installs if i.requirement.name == "ray"]
    assert rays, f"{node_type} never installs ray: nothing would provide `ray start` in the node's environment"
    for req in rays:
        assert _same(req, pin), f"{node_type} installs {req}, pyproject.toml pins {pin}: they must be the same"


def test_the_head_installs_the_cpu_build_of_torch_before_winnow():
    prepared = _prepared()
    head = prepared["head_node_type"]
    installs, editables = _pip_installs(_effective_setup(prepared, head))
    torches = [i for i in installs if i.requirement.name == "torch"]
    assert torches, f"the head ({head}) never installs torch itself: Winnow's torch>=2.4 would pull the CUDA wheel"
    for t in torches:
        assert t.index_url == CPU_INDEX, (
            f"the head installs {t.requirement} from {t.index_url or 'PyPI'}, not the CPU build ({CPU_INDEX})")
        assert str(t.requirement.specifier).startswith("=="), f"the head's torch is not pinned: {t.requirement}"
    assert editables, f"the head ({head}) never installs Winnow (pip install -e)"
    assert max(t.position for t in torches) < min(e.position for e in editables), (
        "the head installs Winnow before the CPU torch: Winnow's torch>=2.4 would first pull PyPI's CUDA build")


def test_gpu_workers_install_the_cuda_build_of_the_heads_torch_before_winnow():
    prepared = _prepared()
    head = prepared["head_node_type"]
    head_torch = {str(i.requirement.specifier) for i in _pip_installs(_effective_setup(prepared, head))[0]
                  if i.requirement.name == "torch"}
    for node_type in prepared["available_node_types"]:
        if node_type == head or not _is_gpu(prepared, node_type):
            continue
        installs, editables = _pip_installs(_effective_setup(prepared, node_type))
        torches = [i for i in installs if i.requirement.name == "torch"]
        assert torches, f"GPU worker {node_type} never installs torch: it would get whatever Winnow's torch>=2.4 picks"
        for t in torches:
            assert t.index_url is None or "/whl/cu" in t.index_url, (
                f"GPU worker {node_type} installs {t.requirement} from {t.index_url}: not a CUDA build")
            assert str(t.requirement.specifier) in head_torch, (
                f"GPU worker {node_type} installs {t.requirement}, the head torch{sorted(head_torch)}: the versions "
                "differ")
        assert editables, f"GPU worker {node_type} never installs Winnow (pip install -e)"
        assert max(t.position for t in torches) < min(e.position for e in editables), (
            f"GPU worker {node_type} installs Winnow before torch: Winnow's torch>=2.4 would pull the newest torch")


def test_no_node_installs_torchvision_torchaudio_or_torchcodec():
    prepared = _prepared()
    for node_type in prepared["available_node_types"]:
        for command in _effective_setup(prepared, node_type):
            found = FORBIDDEN.search(command)
            assert not found, f"{node_type} runs {command!r}, which installs {found.group(0)}: Winnow uses none of them"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in prepared[key]:
            assert not FORBIDDEN.search(command), f"{key} mentions {FORBIDDEN.search(command).group(0)}"


# ---------------------------------------------------------------------------------------------------------- Ray's own setup

# The rule. Ray's default setup_commands (ray/autoscaler/aws/defaults.yaml) are written for its old Deep Learning
# AMI: they activate that image's conda env and otherwise `pip install` a nightly Ray into the system Python.
# cluster.yaml replaces them (on these Ubuntu images they would fail or install the wrong Ray) but must keep what
# Ray needs from its defaults:
#   1. Ray's own start commands, unchanged: cluster.yaml sets neither head_start_ray_commands nor
#      worker_start_ray_commands (or sets them to exactly Ray's), so the head starts with the autoscaling config
#      and ports the launcher expects;
#   2. a `ray` for those start commands on every node: each node's effective setup installs the pinned Ray
#      (test above) in an environment activated from ~/.bashrc, which Ray sources before every command;
#   3. boto3 on the head (Ray's default head_setup_commands), which the autoscaler uses to launch workers;
#   4. node-specific installs (torch) only in head_setup_commands / worker_setup_commands, never in the
#      setup_commands that every node runs.


def test_ray_start_commands_are_rays_own():
    prepared, defaults = _prepared(), _ray_defaults()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert prepared[key] == defaults[key], (
            f"cluster.yaml replaces Ray's {key}: {prepared[key]} instead of {defaults[key]}")


@pytest.mark.parametrize("node_type", _node_types())
def test_every_node_puts_its_environment_on_rays_path(node_type):
    commands = _effective_setup(_prepared(), node_type)
    assert any(re.search(r"activate['\"]?\s*>>\s*~/\.bashrc", c) for c in commands), (
        f"{node_type}: no setup command activates the environment from ~/.bashrc, so Ray's `ray start` (run in a "
        "login shell that sources ~/.bashrc) would not find the ray installed by setup")


def test_the_head_keeps_boto3_for_the_autoscaler():
    prepared = _prepared()
    installs, _ = _pip_installs(_effective_setup(prepared, prepared["head_node_type"]))
    assert any(i.requirement.name == "boto3" for i in installs), (
        "the head never installs boto3 (Ray's default head_setup_commands do): its autoscaler could not launch "
        "AWS workers")


def test_setup_commands_that_every_node_runs_install_no_torch():
    installs, _ = _pip_installs(_raw().get("setup_commands", []))
    torches = [str(i.requirement) for i in installs if i.requirement.name == "torch"]
    assert not torches, (f"setup_commands (run on every node) install {torches}: torch differs by node type and "
                         "belongs in head_setup_commands / worker_setup_commands")


def test_token_auth_is_all_nodes_or_none():
    prepared = _prepared()
    on = {t: any("RAY_AUTH_MODE=token" in c for c in _effective_setup(prepared, t))
          for t in prepared["available_node_types"]}
    assert len(set(on.values())) == 1, (
        f"RAY_AUTH_MODE=token is set on some node types only ({on}): Ray needs the same mode on every node")


# ---------------------------------------------------------------------------------------------------------- files


def _covered(patterns: list[str], name: str) -> bool:
    return any(p.strip().strip("/") == name for p in patterns)


@pytest.mark.parametrize("name", [".venv", "runs", "__pycache__", ".pytest_cache", "*.egg-info"])
def test_rsync_excludes_keep_the_local_environment_outputs_and_caches_off_the_nodes(name):
    excludes = _raw().get("rsync_exclude") or []
    assert _covered(excludes, name), (
        f"rsync_exclude {excludes} does not exclude {name!r}: `ray up` would copy it from the checkout to every node")


def test_rsync_filter_files_exist():
    for name in _raw().get("rsync_filter") or []:
        assert (ROOT / name).is_file(), f"rsync_filter names {name}, which the repository root does not have"


def test_nodes_install_winnow_from_where_file_mounts_put_it():
    raw, prepared = _raw(), _prepared()
    mounts = raw.get("file_mounts") or {}
    for local in mounts.values():
        assert (ROOT / local).exists(), f"file_mounts copies {local!r}, which is not there from the repository root"
    for node_type in prepared["available_node_types"]:
        _, editables = _pip_installs(_effective_setup(prepared, node_type))
        for e in editables:
            assert e.path.rstrip("/") in {r.rstrip("/") for r in mounts}, (
                f"{node_type} runs pip install -e {e.path}, which no file_mounts entry puts on the node ({mounts})")
