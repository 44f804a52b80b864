"""k8s/rayjob.yaml would run Winnow on a KubeRay cluster, as far as that can be checked offline.

No Kubernetes cluster, no cloud and no Docker daemon here: the manifest has never been applied and its image never
built. These tests read k8s/rayjob.yaml and k8s/Dockerfile and check three things:

(a) the RayJob against KubeRay's own CRD schema (`../shared/reference/kuberay/ray.io_rayjobs.yaml` beside the
    clone; skipped when it is absent) the way the API server applies it: a CRD's OpenAPI schema alone lets unknown
    fields through (the API server prunes them, and kubectl's default strict field validation rejects them), so the
    schema is first closed to unknown fields; list-map keys must be unique; int32/int64 must fit. Mangled copies of
    the manifest (a misspelt field, a wrong type, a bad enum, a missing required field) must be rejected, so a
    passing validation means something;
(b) what Winnow relies on, always (no schema file needed): the entry point, the retry policy that resumes the same
    run folder on S3, the GPU workers and what they hold, the image's Ray and torch, S3 credentials and token
    authentication the same on every pod, and a few of KubeRay's own controller-side rules;
(c) the entry point is the one docs/cluster.md documents for `ray job submit`, with options the README's command table
    lists.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import InvalidRequirement, Requirement

from jobs import config_args
from schemas.base import ConfigError
from schemas.config import load_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
MANIFEST = K8S / "rayjob.yaml"
DOCKERFILE = K8S / "Dockerfile"
DOCKERIGNORE = K8S / "Dockerfile.dockerignore"  # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile
CRD = ROOT.parent / "shared" / "reference" / "kuberay" / "ray.io_rayjobs.yaml"
GPU = "nvidia.com/gpu"
ENTRY = ["python", "-m", "jobs.generate"]
RAY_IMAGE = re.compile(r"^rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>3)(?P<minor>\d+)(?:-\S+)?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYJOB_NAME = 47  # KubeRay: 53 (RayCluster names) minus the 6 characters it appends for the job's cluster
FORBIDDEN = re.compile(r"\btorch(?:vision|audio|codec)\b")
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                     "-r", "--requirement", "-t", "--target", "--prefix", "--root", "--python"}


# ---------------------------------------------------------------------------------------------------------- reading


def _manifest() -> dict:
    """The one RayJob in k8s/rayjob.yaml (a fresh copy each call: tests mangle it)."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    rayjobs = [d for d in docs if d.get("kind") == "RayJob"]
    assert len(rayjobs) == 1, f"{MANIFEST.name} should hold exactly one RayJob, found {len(rayjobs)}"
    return rayjobs[0]


def _spec() -> dict:
    return _manifest()["spec"]


def _ray_pods(spec: dict | None = None) -> dict[str, dict]:
    """Pod spec per Ray group: 'head' and 'worker:<groupName>'."""
    cluster = (spec or _spec())["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster.get("workerGroupSpecs") or []:
        pods[f"worker:{group['groupName']}"] = group["template"]["spec"]
    return pods


def _ray_container(pod: dict) -> dict:
    """KubeRay treats the first container of a Ray pod as the Ray container (utils.RayContainerIndex = 0)."""
    return pod["containers"][0]


def _entrypoint() -> list[str]:
    return shlex.split(_spec()["entrypoint"])


def _entry_args():
    """The entry point's arguments after `python -m jobs.generate`, parsed as Winnow parses CONFIG and --set. Other
    options are refused: --overwrite would make every retry delete what the attempts before it wrote, and the
    manifest needs no other."""
    tokens = _entrypoint()
    assert "--overwrite" not in tokens, (
        "--overwrite in spec.entrypoint: every retry would delete the rows written before it")
    try:
        return config_args.parse(config_args.parser("winnow generate", ""), tokens[3:])
    except config_args.ArgumentError as err:
        pytest.fail(f"spec.entrypoint should pass CONFIG and --set only: {err}")


def _repo_config(config: str) -> str:
    """The repository path of the entry point's config, which the image holds under the copied repository."""
    code = _code_dir()
    full = config if config.startswith("/") else f"{code}/{config}"
    assert full.startswith(code + "/"), (
        f"the entry point's config {config} is not under {code}, where k8s/Dockerfile puts the repository")
    return full[len(code) + 1:]


def _pyproject_ray() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    rays = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert len(rays) == 1, f"pyproject.toml should list ray once among the dependencies, found {rays}"
    return rays[0]


def _pinned_ray_version() -> str:
    pin = _pyproject_ray()
    specs = list(pin.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"pyproject.toml should pin ray exactly, found {pin}"
    return specs[0].version


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined and comments dropped, as Docker reads it."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{DOCKERFILE.name} ends inside a continued instruction"
    return instructions


def _code_dir() -> str:
    """Where the image holds the repository: the destination of `COPY . DIR`, which must also be the WORKDIR."""
    copies = [shlex.split(args) for word, args in _dockerfile() if word == "COPY"]
    dirs = [tokens[-1] for tokens in copies if [t for t in tokens[:-1] if not t.startswith("--")] == ["."]]
    assert len(dirs) == 1, f"{DOCKERFILE.name} should copy the build context (the repository) once: COPY . DIR"
    return dirs[0].rstrip("/")


def _pip_installs() -> list[tuple[int, str, str]]:
    """(instruction index, 'req' or 'path', value) for every `pip install` argument in the Dockerfile's RUNs."""
    found = []
    for position, (word, args) in enumerate(_dockerfile()):
        if word != "RUN":
            continue
        for segment in re.split(r"&&|\|\||;|\|", args):
            try:
                tokens = shlex.split(segment)
            except ValueError:
                continue
            starts = [i for i in range(len(tokens) - 1)
                      if (tokens[i] in ("pip", "pip3") or tokens[i].endswith("/pip")) and tokens[i + 1] == "install"]
            if not starts:
                continue
            rest = tokens[starts[0] + 2:]
            j = 0
            while j < len(rest):
                arg = rest[j]
                if arg in ("-e", "--editable") and j + 1 < len(rest):
                    found.append((position, "path", rest[j + 1]))
                    j += 2
                    continue
                if arg in PIP_VALUE_OPTIONS:
                    j += 2
                    continue
                if arg.startswith("."):
                    found.append((position, "path", arg.split("[")[0]))
                elif not arg.startswith("-") and "/" not in arg:
                    try:
                        Requirement(arg)
                        found.append((position, "req", arg))
                    except InvalidRequirement:
                        pass
                j += 1
    return found


# ---------------------------------------------------------------------------------------------------------- (a) schema


@functools.lru_cache(maxsize=1)
def _crd_schema() -> dict:
    """spec.versions[name=v1].schema.openAPIV3Schema of KubeRay's RayJob CRD (1.4 MB of YAML: libyaml reads it in
    under a second, pure-Python PyYAML in several)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    assert crd.get("kind") == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayJob", (
        f"{CRD} is not the RayJob CRD")
    versions = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert len(versions) == 1, f"{CRD} has no (or several) v1 versions"
    return versions[0]["schema"]["openAPIV3Schema"]


def _closed(node):
    """The schema as the API server applies it to a create: every object whose schema lists its properties (and does
    not keep unknown fields with x-kubernetes-preserve-unknown-fields) takes no others. Without this, the CRD's schema
    accepts a misspelt field, which the API server would drop or, under kubectl's default strict field validation,
    refuse. `nullable: true` also admits null."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _closed(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [_closed(sub) for sub in value]
        else:
            out[key] = value  # enum, default, required, x-kubernetes-*: data, not subschemas
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _list_type(validator, list_type, instance, schema):
    """x-kubernetes-list-type: a 'map' list holds one item per key (defaults filled in), a 'set' no duplicates."""
    from jsonschema import ValidationError

    if not validator.is_type(instance, "array"):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        defaults = {k: ((schema.get("items") or {}).get("properties") or {}).get(k, {}).get("default") for k in keys}
        seen: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            values = {k: item.get(k, defaults[k]) for k in keys}
            key = tuple(json.dumps(v) for v in values.values())
            if key in seen:
                yield ValidationError(f"items {seen[key]} and {i} share the key {values}")
            seen.setdefault(key, i)
    elif list_type == "set":
        items = [json.dumps(item, sort_keys=True) for item in instance]
        if len(set(items)) != len(items):
            yield ValidationError("a list-type set holds duplicates")


def _cel_rules(validator, rules, instance, schema):
    """x-kubernetes-validations are CEL, which this test does not evaluate. Transition rules (oldSelf) only apply to
    updates; any other rule reached by the manifest fails loudly, so nobody mistakes it for checked."""
    from jsonschema import ValidationError

    for rule in rules:
        if "oldSelf" in rule.get("rule", ""):
            continue
        yield ValidationError(f"CEL rule {rule.get('rule')!r} ({rule.get('message')}) is not evaluated offline: "
                              "check it by hand and teach tests/test_kubernetes.py about it")


@functools.lru_cache(maxsize=2)
def _validator(closed: bool = True):
    import jsonschema  # a dependency of Ray's: present wherever these tests run

    formats = jsonschema.FormatChecker(formats=())

    @formats.checks("int32")
    def _int32(value):
        return not isinstance(value, int) or -2**31 <= value < 2**31

    @formats.checks("int64")
    def _int64(value):
        return not isinstance(value, int) or -2**63 <= value < 2**63

    cls = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type,
                                                                    "x-kubernetes-validations": _cel_rules})
    schema = _closed(_crd_schema()) if closed else _crd_schema()
    return cls(schema, format_checker=formats)


def _schema_errors(doc: dict, closed: bool = True) -> list[tuple[str, str]]:
    errors = _validator(closed).iter_errors(doc)
    return sorted((".".join(str(p) for p in e.absolute_path), e.message) for e in errors)


@pytest.fixture(scope="module")
def crd():
    """Skips the schema tests when ../shared/reference/kuberay is not beside the clone."""
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent: the RayJob cannot be checked against KubeRay's schema")
    return _crd_schema()


def test_the_rayjob_passes_kuberays_crd_schema_as_the_api_server_applies_it(crd):
    errors = _schema_errors(_manifest())
    assert not errors, "k8s/rayjob.yaml does not pass KubeRay's RayJob schema:\n" + "\n".join(
        f"  {path or '(root)'}: {message}" for path, message in errors)


def _worker(doc):
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _worker_container(doc):
    return _worker(doc)["template"]["spec"]["containers"][0]


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


# (what is mangled, how, the path of the error the schema must report)
MANGLED = [
    ("a misspelt field under spec", lambda d: _rename(d["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinish"),
     "spec"),
    ("a misspelt field in a container", lambda d: _rename(_worker_container(d)["resources"], "limits", "limit"),
     "spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers.0.resources"),
    ("backoffLimit as a string", lambda d: d["spec"].__setitem__("backoffLimit", "3"), "spec.backoffLimit"),
    ("backoffLimit past int32", lambda d: d["spec"].__setitem__("backoffLimit", 2**31), "spec.backoffLimit"),
    ("replicas as a string", lambda d: _worker(d).__setitem__("replicas", "2"),
     "spec.rayClusterSpec.workerGroupSpecs.0.replicas"),
    ("shutdownAfterJobFinishes as a string", lambda d: d["spec"].__setitem__("shutdownAfterJobFinishes", "yes"),
     "spec.shutdownAfterJobFinishes"),
    ("an auth mode KubeRay does not know", lambda d: d["spec"]["rayClusterSpec"]["authOptions"].__setitem__(
        "mode", "tokens"), "spec.rayClusterSpec.authOptions.mode"),
    ("a worker group without its groupName", lambda d: _worker(d).pop("groupName"),
     "spec.rayClusterSpec.workerGroupSpecs.0"),
    ("a memory quantity Kubernetes cannot parse", lambda d: _worker_container(d)["resources"]["limits"].__setitem__(
        "memory", "24 GiB"), "spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers.0.resources.limits"),
    ("two containers of one name", lambda d: _worker(d)["template"]["spec"]["containers"].append(
        copy.deepcopy(_worker_container(d))), "spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers"),
]


@pytest.mark.parametrize("what, mangle, path", MANGLED, ids=[m[0] for m in MANGLED])
def test_the_schema_rejects_a_mangled_rayjob(crd, what, mangle, path):
    doc = _manifest()
    mangle(doc)
    errors = _schema_errors(doc)
    assert errors, f"{what}: KubeRay's schema (as the API server applies it) accepted it"
    assert any(p == path or p.startswith(path + ".") for p, _ in errors), (
        f"{what}: expected an error at {path}, got {errors}")


def test_the_crd_schema_alone_lets_a_misspelt_field_through(crd):
    """Why the schema is closed before validating: the CRD lists properties without additionalProperties: false, so
    plain JSON Schema accepts a misspelt spec field (shutdownAfterJobFinish would silently leave the GPUs running)."""
    doc = _manifest()
    _rename(doc["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinish")
    assert not _schema_errors(doc, closed=False), "the raw CRD schema already rejects unknown fields: simplify _closed"
    assert any("shutdownAfterJobFinish" in message for _, message in _schema_errors(doc))


# ---------------------------------------------------------------------------------------------------------- (b) fields


def test_it_is_a_kuberay_rayjob_with_a_name_kuberay_accepts():
    doc = _manifest()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob", (doc["apiVersion"], doc["kind"])
    name = doc["metadata"]["name"]
    assert DNS1035_LABEL.match(name) and len(name) <= MAX_RAYJOB_NAME, (
        f"metadata.name {name!r}: KubeRay wants a DNS-1035 label of at most {MAX_RAYJOB_NAME} characters")


def test_the_entry_point_runs_jobs_generate_on_a_config_the_image_holds():
    tokens = _entrypoint()
    assert tokens[:3] == ENTRY, f"spec.entrypoint should start with {' '.join(ENTRY)}, got {tokens[:3]}"
    config = _entry_args().config
    assert (ROOT / _repo_config(config)).is_file(), f"{config} is no file of this repository"


def _entry_config():
    args = _entry_args()
    try:
        return load_config(str(ROOT / _repo_config(args.config)), args.overrides)
    except ConfigError as err:
        pytest.fail("the entry point's config and --set overrides do not validate:\n  " + "\n  ".join(err.problems))


def test_the_entry_point_writes_to_s3_and_never_overwrites():
    config = _entry_config()  # refuses --overwrite first
    assert config.output.path.startswith("s3://"), (
        f"output.path {config.output.path!r}: every pod writes the run folder, and a retry runs on new pods, so it "
        "must be on S3")


def test_retries_recreate_the_cluster_and_resume_the_same_run_folder():
    spec = _spec()
    assert isinstance(spec.get("backoffLimit"), int) and spec["backoffLimit"] >= 1, (
        f"spec.backoffLimit {spec.get('backoffLimit')}: a failed attempt would not be retried")
    assert spec.get("shutdownAfterJobFinishes") is True, "the cluster (and its GPUs) would outlive the job"
    # KubeRay refuses backoffLimit with clusterSelector or InteractiveMode; either would also reuse a cluster.
    assert not spec.get("clusterSelector") and spec.get("rayClusterSpec"), "each attempt needs a cluster of its own"
    assert spec.get("submissionMode", "K8sJobMode") != "InteractiveMode", "InteractiveMode takes no retries"
    assert not spec.get("suspend"), "a suspended RayJob never runs"
    assert not spec.get("activeDeadlineSeconds"), (
        "activeDeadlineSeconds: KubeRay never retries an attempt that failed on its deadline (DeadlineExceeded)")
    assert spec.get("ttlSecondsAfterFinished", 0) >= 0
    assert (spec.get("submitterConfig") or {}).get("backoffLimit", 2) >= 1, "a failed submitter pod is not retried"


def test_the_gpu_workers_hold_the_actors_the_entry_point_asks_for():
    r = _entry_config().resources
    assert r.gpus_per_actor > 0, "resources.gpus_per_actor is 0: the actors would run on the workers' CPUs"
    groups = _spec()["rayClusterSpec"].get("workerGroupSpecs") or []
    gpus = 0
    for group in groups:
        res = _ray_container(group["template"]["spec"]).get("resources") or {}
        limit, request = (res.get("limits") or {}).get(GPU), (res.get("requests") or {}).get(GPU)
        if limit is None:
            continue
        assert request is None or str(request) == str(limit), (
            f"worker group {group['groupName']}: Kubernetes wants {GPU} requests equal to limits")
        assert r.cpus_per_actor <= _cpus(res["limits"]["cpu"]), (
            f"worker group {group['groupName']}: an actor reserves {r.cpus_per_actor} CPUs, a pod has "
            f"{res['limits']['cpu']}")
        per_pod = int(limit)
        assert per_pod >= r.gpus_per_actor, f"{group['groupName']}: {per_pod} GPUs per pod < gpus_per_actor"
        gpus += per_pod * group.get("numOfHosts", 1) * group["maxReplicas"]
    assert gpus, f"no worker group asks for {GPU}: the models would have no GPU"
    assert r.actors * r.gpus_per_actor <= gpus, (
        f"{r.actors} actors x {r.gpus_per_actor} GPUs, but the worker groups hold {gpus} GPUs at most")
    head = _ray_container(_ray_pods()["head"]).get("resources") or {}
    assert GPU not in (head.get("limits") or {}), "the head runs the driver, not the models: no GPU"


def test_every_ray_pod_and_the_submitter_run_one_image_of_the_pinned_ray():
    spec = _spec()
    images = {name: _ray_container(pod)["image"] for name, pod in _ray_pods(spec).items()}
    if spec.get("submitterPodTemplate"):
        images["submitter"] = spec["submitterPodTemplate"]["spec"]["containers"][0]["image"]
    assert len(set(images.values())) == 1, f"the pods run different images: {images}"
    image = next(iter(images.values()))
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (
        f"image {image}: give it a tag of its own, so that every pod and every retry runs the same code")
    pin = _pinned_ray_version()
    assert spec["rayClusterSpec"].get("rayVersion") == pin, (
        f"rayClusterSpec.rayVersion {spec['rayClusterSpec'].get('rayVersion')}, pyproject.toml pins ray=={pin}")


def test_the_image_is_rays_own_for_the_pinned_ray_and_a_python_winnow_supports():
    import ray

    froms = [[t for t in args.split() if not t.startswith("--")][0] for w, args in _dockerfile() if w == "FROM"]
    assert len(froms) == 1, f"{DOCKERFILE.name} should have one FROM, found {froms}"
    match = RAY_IMAGE.match(froms[0])
    assert match, f"FROM {froms[0]}: expected Ray's own image, rayproject/ray:VERSION-pyXY[-PLATFORM]"
    pin = _pinned_ray_version()
    assert match["ray"] == pin == ray.__version__, (
        f"the image's Ray {match['ray']}, pyproject.toml's {pin}, these tests' {ray.__version__}: all must agree")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    python = f"{match['py']}.{match['minor']}"
    from packaging.specifiers import SpecifierSet

    assert python in SpecifierSet(requires), f"the image's Python {python} is outside requires-python {requires}"
    for _, kind, value in _pip_installs():
        if kind == "req" and Requirement(value).name == "ray":
            assert str(Requirement(value).specifier) == f"=={pin}", f"the image installs {value}, not ray=={pin}"


def test_the_image_installs_cis_torch_before_winnow_from_the_copied_code():
    installs = _pip_installs()
    torches = [(pos, Requirement(v)) for pos, kind, v in installs if kind == "req" and Requirement(v).name == "torch"]
    assert torches, "the image never installs torch itself: Winnow's torch>=2.4 would take whatever is newest"
    ci = set(re.findall(r"pip install '?torch==(\d+(?:\.\d+)*)", (ROOT / "README.md").read_text()))
    assert len(ci) == 1, f"the README's install lines (what CI runs) should name one torch, found {sorted(ci)}"
    for _, req in torches:
        assert str(req.specifier) == f"=={next(iter(ci))}", f"the image installs {req}, CI tests torch=={ci}"
    code = _code_dir()
    workdirs = [args for w, args in _dockerfile() if w == "WORKDIR"]
    assert workdirs and workdirs[-1].rstrip("/") == code, f"WORKDIR {workdirs} should be the copied repository {code}"
    projects = [(pos, v) for pos, kind, v in installs if kind == "path"]
    assert projects, "the image never installs Winnow from the copied code (pip install [-e] .)"
    for pos, path in projects:
        assert path.rstrip("/") in (".", code), f"pip install {path}: not the copied repository {code}"
    assert max(p for p, _ in torches) < min(p for p, _ in projects), (
        "Winnow is installed before torch: its torch>=2.4 would first pull another torch")


def test_no_image_layer_installs_torchvision_torchaudio_or_torchcodec():
    for word, args in _dockerfile():
        found = FORBIDDEN.search(args)
        assert not (word == "RUN" and found), f"RUN {args!r} installs {found.group(0)}: Winnow uses none of them"


@pytest.mark.parametrize("name", [".git", ".venv", "runs", "**/__pycache__", "*.egg-info", ".pytest_cache"])
def test_the_build_context_leaves_out_history_environments_outputs_and_caches(name):
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert name in patterns, f"{DOCKERIGNORE.name} does not leave out {name!r}: it would be copied into the image"


def _credential_sources(pod: dict) -> set[str]:
    container = _ray_container(pod)
    sources = {f"secret {e['secretRef']['name']}" for e in container.get("envFrom") or [] if "secretRef" in e}
    for env in container.get("env") or []:
        if env["name"] in AWS_KEYS:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            assert ref, f"{env['name']} is written in the manifest: put it in a Secret"
            sources.add(f"secret {ref['name']}")
    if pod.get("serviceAccountName"):
        sources.add(f"service account {pod['serviceAccountName']}")  # IRSA / EKS Pod Identity
    return sources


def test_every_ray_pod_gets_the_s3_credentials_the_same_way():
    """The driver (head) writes the lease, manifest and prompt set; every actor (GPU workers) writes its rows."""
    sources = {name: _credential_sources(pod) for name, pod in _ray_pods().items()}
    assert sources["head"], "the head gets no S3 credentials (a Secret in envFrom/env, or a service account)"
    assert len({frozenset(s) for s in sources.values()}) == 1, f"the pods get S3 credentials differently: {sources}"


def test_token_authentication_is_all_pods_or_none():
    cluster = _spec()["rayClusterSpec"]
    mode = (cluster.get("authOptions") or {}).get("mode", "disabled")
    by_hand = {name: any(e["name"] == "RAY_AUTH_MODE" and e.get("value") == "token"
                         for e in _ray_container(pod).get("env") or [])
               for name, pod in _ray_pods().items()}
    if mode == "token":
        assert not any(by_hand.values()), f"authOptions sets RAY_AUTH_MODE on every pod; set by hand too: {by_hand}"
        version = tuple(int(x) for x in cluster["rayVersion"].split("."))
        assert version >= (2, 52, 0), "KubeRay refuses authOptions.mode token below rayVersion 2.52.0"
    else:
        assert len(set(by_hand.values())) == 1, f"RAY_AUTH_MODE=token on some pods only ({by_hand}): Ray needs all"


# ---------------------------------------------------------------------------------------------------------- (c) README


def _documented_submits() -> list[tuple[str, list[str]]]:
    """The `python -m jobs.generate ...` part of every `ray job submit ... -- ...` in a code block of the README and
    the docs (continuation lines joined), with the file it is in (docs/cluster.md holds the README's former one)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "kubernetes.md":
            continue  # the doc of this manifest: not evidence of the documented command
        in_code, pending = False, ""
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_code, pending = not in_code, ""
                continue
            if not in_code:
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command, pending = pending + line, ""
            if "ray job submit" in command and " -- " in command:
                tokens = shlex.split(command.split(" -- ", 1)[1], comments=True)
                if tokens[:3] == ENTRY:
                    found.append((path.name, tokens))
    return found


def test_the_entry_point_is_the_one_the_docs_document_for_ray_job_submit():
    documented = _documented_submits()
    assert any(name == "cluster.md" for name, _ in documented), (
        "docs/cluster.md shows no `ray job submit ... -- python -m jobs.generate CONFIG` in a code block")
    tokens = _entrypoint()
    assert tokens[:3] == ENTRY
    configs = {t[3] for _, t in documented if len(t) > 3 and (ROOT / t[3]).is_file()}
    ours = _repo_config(_entry_args().config)
    assert ours in configs, f"the manifest runs {ours}; the README and docs submit {sorted(configs)}"
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if "`winnow generate CONFIG" in line]
    assert table, "the README's command table has no `winnow generate CONFIG ...` line"
    documented_options = set(re.findall(r"\[(--[a-z][a-z-]*)", table[0]))
    used = {t.split("=", 1)[0] for t in tokens[4:] if t.startswith("--")}
    assert used <= documented_options, f"the manifest passes {sorted(used - documented_options)}, not documented"
