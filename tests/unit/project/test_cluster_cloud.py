"""cluster/aws.yaml, cluster/gcp.yaml and cluster/kubernetes/ hold up, offline.

The launcher configs pass Ray's schema and its own config preparation; every pod template
of the KubeRay manifests is a valid Kubernetes pod template (Kubernetes' schema, strict:
an unknown field fails), the custom resources match KubeRay's CRD schemas
(tests/support/kuberay/), the RayJob's config passes ``raytrain plan``, and secrets are
only ever referenced. No network, no cluster, no Ray started.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from importlib import resources
from pathlib import PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml
from packaging.specifiers import SpecifierSet
from paths import ROOT, TESTS
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain_app import cli
from raytrain_app.config import load_config
from raytrain_app.planning.environment import Resources, detect_environment
from raytrain_app.planning.rules import make_plan

CLUSTER = ROOT / "cluster"
KUBERNETES = CLUSTER / "kubernetes"
LAUNCHERS = {"aws": CLUSTER / "aws.yaml", "gcp": CLUSTER / "gcp.yaml"}
CRD_SCHEMAS = {
    "RayCluster": TESTS / "support" / "kuberay" / "raycluster-v1.schema.yaml",
    "RayJob": TESTS / "support" / "kuberay" / "rayjob-v1.schema.yaml",
}
# A Kubernetes version kubernetes-validate bundles; managed clusters run it or newer.
KUBERNETES_VERSION = "1.34"
GPU = "nvidia.com/gpu"
TOKEN_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
SECRET_LIKE = re.compile(r"TOKEN|SECRET|PASSWORD|ACCESS_KEY|CREDENTIAL", re.I)


def _manifests() -> list[tuple[str, dict]]:
    """Every object in cluster/kubernetes/*.yaml, with the file it is in."""
    return [
        (path.name, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


MANIFESTS = _manifests()


def _objects(kind: str) -> list[dict]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def _only(kind: str) -> dict:
    (obj,) = _objects(kind)
    return obj


def _cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def _ray_templates(obj: dict) -> list[tuple[str, dict]]:
    """The pod templates of a RayCluster or RayJob that run Ray: head, then worker groups."""
    spec = _cluster_spec(obj)
    groups = [(f"workers-{g['groupName']}", g["template"]) for g in spec["workerGroupSpecs"]]
    return [("head", spec["headGroupSpec"]["template"]), *groups]


def _pod_templates() -> list[tuple[str, dict]]:
    """(label, template) for every pod template in the manifests, the RayJob's submitter too."""
    found = []
    for file, obj in MANIFESTS:
        if obj["kind"] not in CRD_SCHEMAS:
            continue
        named = _ray_templates(obj)
        if "submitterPodTemplate" in obj["spec"]:
            named.append(("submitter", obj["spec"]["submitterPodTemplate"]))
        prefix = f"{file}:{obj['kind']}/{obj['metadata']['name']}"
        found += [(f"{prefix}:{label}", template) for label, template in named]
    return found


POD_TEMPLATES = _pod_templates()


def _containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def _gpus(obj: dict) -> int:
    """GPUs of a RayCluster or RayJob's cluster: replicas x GPUs of each worker pod."""
    return sum(
        group["replicas"]
        * int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get(GPU, 0))
        for group in _cluster_spec(obj)["workerGroupSpecs"]
    )


def _job_config() -> tuple[dict, str]:
    """The RayJob's ``raytrain train`` config: (its ConfigMap, the file's text)."""
    args = shlex.split(_only("RayJob")["spec"]["entrypoint"])
    path = PurePosixPath(args[args.index("--config") + 1])
    (config_map,) = [c for c in _objects("ConfigMap") if path.name in c["data"]]
    return config_map, config_map["data"][path.name]


# --------------------------------------------------------------------------- launcher configs


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    return json.loads((resources.files("ray") / "autoscaler" / "ray-schema.json").read_text())


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def launcher(request) -> dict:
    return yaml.safe_load(LAUNCHERS[request.param].read_text())


def test_launcher_configs_match_the_schema_shipped_with_ray(launcher, ray_schema):
    jsonschema.validate(launcher, ray_schema)


def test_launcher_configs_pass_rays_own_preparation_and_validation(launcher):
    # prepare_config merges the provider's defaults.yaml shipped with Ray (offline) and
    # validate_config checks the result against the schema and the node types. What needs
    # credentials and the cloud SDKs (boto3, googleapiclient) is the provider's bootstrap that
    # `ray up` runs next: IAM role or service account, key pair, security group or firewall,
    # subnets, the AMI and zone lookups. That part is not run here.
    prepared = prepare_config(copy.deepcopy(launcher))
    validate_config(prepared)
    types = prepared["available_node_types"]
    head = types.pop(prepared["head_node_type"])
    assert head["resources"].get("GPU", 0) == 0
    # The GPU workers are up when a run starts: raytrain plans against the GPUs it sees.
    assert [t["resources"]["GPU"] for t in types.values()] == [1]
    assert all(t["min_workers"] == t["max_workers"] > 0 for t in types.values())


def test_launchers_install_torch_first_and_start_ray_with_token_auth(launcher):
    setup = " ".join(launcher["setup_commands"])
    assert setup.index("install --quiet torch==2.13.0") < setup.index("/raytrain_app[s3]")
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "cluster/ray-token"
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    (head_start,) = [c for c in launcher["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=${RAYTRAIN_DASHBOARD_HOST:-127.0.0.1}" in head_start.split()
    assert "0.0.0.0" not in head_start
    # The token reaches the nodes as a file and is never on a command line.
    commands = [*launcher["setup_commands"], *launcher["head_setup_commands"], *starts]
    assert not any("RAY_AUTH_TOKEN" in c or "ray-token" in c for c in commands)


# --------------------------------------------------------------------------- Kubernetes objects


@pytest.mark.parametrize(
    "template", [t for _, t in POD_TEMPLATES], ids=[label for label, _ in POD_TEMPLATES]
)
def test_every_pod_template_is_a_valid_kubernetes_pod_template(template):
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "raytrain"},
        "template": template,
    }
    kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    "obj",
    [doc for _, doc in MANIFESTS if doc["apiVersion"] == "v1"],
    ids=[f"{file}:{doc['kind']}" for file, doc in MANIFESTS if doc["apiVersion"] == "v1"],
)
def test_plain_objects_are_valid_kubernetes_objects(obj):
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _strict(schema):
    """A CRD schema as the API server applies it under strict field validation (kubectl's
    default): an object that lists its fields accepts no others."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    open_object = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and "additionalProperties" not in schema and not open_object:
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    return {kind: _strict(yaml.safe_load(path.read_text())) for kind, path in CRD_SCHEMAS.items()}


@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_custom_resources_match_kuberays_crd_schema(kind, crd_schemas):
    (obj,) = _objects(kind)
    assert obj["apiVersion"] == "ray.io/v1"
    jsonschema.validate(obj, crd_schemas[kind], cls=jsonschema.Draft7Validator)


def test_the_validation_catches_broken_manifests(crd_schemas):
    cluster = copy.deepcopy(_only("RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2  # a typo
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(cluster, crd_schemas["RayCluster"], cls=jsonschema.Draft7Validator)
    template = copy.deepcopy(_ray_templates(_only("RayJob"))[0][1])
    template["spec"]["containers"][0]["env"][1]["valueFrom"]["secretRef"] = {"name": "x"}
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="secretRef"):
        kubernetes_validate.validate(
            {**broken, "template": template}, KUBERNETES_VERSION, strict=True
        )


# --------------------------------------------------------------------------- what they say


def test_every_container_authenticates_with_the_token_secret():
    (secret,) = [s for s in _objects("Secret") if "auth_token" in s["stringData"]]
    token_ref = {"name": secret["metadata"]["name"], "key": "auth_token"}
    for label, template in POD_TEMPLATES:
        for container in _containers(template):
            env = _env(container)
            assert env["RAY_AUTH_MODE"]["value"] == "token", label
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == token_ref, label
    for kind in CRD_SCHEMAS:
        auth = _cluster_spec(_only(kind))["authOptions"]  # KubeRay's own client uses it
        assert auth == {"mode": "token", "secretName": token_ref["name"]}


def test_secrets_are_only_referenced_never_inlined():
    secrets = {s["metadata"]["name"] for s in _objects("Secret")}
    for label, template in POD_TEMPLATES:
        for container in _containers(template):
            for name, entry in _env(container).items():
                if SECRET_LIKE.search(name) or name.startswith("AWS_"):
                    assert "value" not in entry, f"{label}: {name} is inlined"
                    assert entry["valueFrom"]["secretKeyRef"]["name"] in secrets, label
            for source in container.get("envFrom", []):
                assert source["secretRef"]["name"] in secrets, label
            command = " ".join(container.get("command", []) + container.get("args", []))
            assert "RAY_AUTH_TOKEN" not in command, label
    assert "RAY_AUTH_TOKEN" not in _only("RayJob")["spec"]["entrypoint"]
    # What is committed are placeholders; real values are created with kubectl.
    for secret in _objects("Secret"):
        assert set(secret["stringData"].values()) == {"REPLACE_ME"}
        assert "data" not in secret


def test_the_dashboard_stays_inside_the_cluster():
    for kind in CRD_SCHEMAS:
        head = _cluster_spec(_only(kind))["headGroupSpec"]
        assert head.get("serviceType", "ClusterIP") == "ClusterIP"
        assert not head.get("enableIngress", False)
    assert not _objects("Ingress")
    assert all(s["spec"].get("type") in (None, "ClusterIP") for s in _objects("Service"))


def test_gpu_worker_groups_request_gpus_and_keep_their_size():
    for kind in CRD_SCHEMAS:
        for group in _cluster_spec(_only(kind))["workerGroupSpecs"]:
            resources_ = group["template"]["spec"]["containers"][0]["resources"]
            assert int(resources_["limits"][GPU]) >= 1
            assert resources_["requests"][GPU] == resources_["limits"][GPU]
            assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        assert _gpus(_only(kind)) == 2


def test_every_ray_pod_mounts_the_shared_run_directory():
    (claim,) = _objects("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mount_paths = set()
    for kind in CRD_SCHEMAS:
        for label, template in _ray_templates(_only(kind)):
            volumes = {
                v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in template["spec"]["volumes"]
                if "persistentVolumeClaim" in v
            }
            (container,) = template["spec"]["containers"]
            mounts = [m for m in container["volumeMounts"] if m["name"] in volumes]
            assert [volumes[m["name"]] for m in mounts] == [claim["metadata"]["name"]], label
            mount_paths.add(mounts[0]["mountPath"])
    _, config = _job_config()
    assert mount_paths == {yaml.safe_load(config)["experiment"]["output_dir"]}


def test_the_rayjob_trains_with_the_config_map_mounted_on_its_head():
    job = _only("RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    args = shlex.split(job["spec"]["entrypoint"])
    assert args[:2] == ["raytrain", "train"] and "--no-progress" in args
    config_path = PurePosixPath(args[args.index("--config") + 1])
    config_map, _ = _job_config()
    head = _ray_templates(job)[0][1]["spec"]
    volumes = {v["name"]: v.get("configMap", {}).get("name") for v in head["volumes"]}
    mounts = [
        PurePosixPath(m["mountPath"])
        for m in head["containers"][0]["volumeMounts"]
        if volumes.get(m["name"]) == config_map["metadata"]["name"]
    ]
    assert mounts == [config_path.parent]


def test_images_run_the_ray_version_the_manifests_declare():
    (base,) = re.findall(
        r"^FROM rayproject/ray:(\S+)", (KUBERNETES / "Dockerfile").read_text(), re.M
    )
    ray_version = base.split("-")[0]
    ray_range = re.search(r'"ray\[[^\]]*\]([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert ray_version in SpecifierSet(ray_range)  # the image's Ray is one raytrain supports
    for kind in CRD_SCHEMAS:
        assert _cluster_spec(_only(kind))["rayVersion"] == ray_version
    images = {c["image"] for _, t in POD_TEMPLATES for c in _containers(t)}
    assert len(images) == 1  # one image, built from the Dockerfile, everywhere


# --------------------------------------------------------------------------- the job's config


@pytest.fixture
def job_config_file(tmp_path, monkeypatch):
    """The RayJob's config as a file, in an empty cwd, with no cluster or SLURM job in sight
    and ``ray.init`` failing the test if the plan reaches it."""

    def no_ray(*args, **kwargs):
        raise AssertionError("raytrain plan started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    for name in ("RAY_ADDRESS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.yaml"
    path.write_text(_job_config()[1])
    return path


def test_the_rayjob_config_passes_raytrain_plan(job_config_file, capsys):
    assert cli.main(["plan", "--config", str(job_config_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == _gpus(_only("RayJob"))
    assert plan["effective_batch_size"] % plan["world_size"] == 0


def test_the_rayjob_config_plans_one_worker_per_gpu_of_its_cluster(job_config_file):
    job = _only("RayJob")
    templates = _ray_templates(job)
    replicas = [1] + [g["replicas"] for g in _cluster_spec(job)["workerGroupSpecs"]]
    node_cpus = tuple(
        float(template["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        for (_, template), count in zip(templates, replicas, strict=True)
        for _ in range(count)
    )
    cluster = Resources(
        cpus=sum(node_cpus),
        gpus=_gpus(job),
        nodes=len(node_cpus),
        source="ray cluster",
        node_cpus=node_cpus,
    )
    env = detect_environment({}).with_resources(cluster)
    plan = make_plan(load_config(job_config_file), env)
    assert (plan.use_gpu, plan.world_size, plan.backend, plan.fits) == (True, 2, "nccl", True)
