"""Write the small KubeRay CRD schemas in this folder from KubeRay's own CRD files.

    python tests/support/kuberay/trim_kuberay_crd.py v1.7.0 <commit> \\
        ray.io_rayclusters.yaml tests/support/kuberay/raycluster-v1.schema.yaml

Keeps the ``v1`` version's ``openAPIV3Schema`` without ``status``, and replaces every pod
template (``PodTemplateSpec``) with an open object: the pod templates are validated against
the Kubernetes schema itself (kubernetes-validate, strict), which is stricter than the copy
of it in the CRD, and dropping them makes the files about 30 times smaller.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

OPEN_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _is_pod_template(node: dict) -> bool:
    keys = set(node.get("properties", {}))
    return node.get("type") == "object" and keys == {"metadata", "spec"} and _has_containers(node)


def _has_containers(node: dict) -> bool:
    return "containers" in node["properties"]["spec"].get("properties", {})


def trimmed(node):
    """``node`` with every pod template replaced by an open object."""
    if isinstance(node, dict):
        if _is_pod_template(node):
            return dict(OPEN_OBJECT)
        return {key: trimmed(value) for key, value in node.items()}
    if isinstance(node, list):
        return [trimmed(item) for item in node]
    return node


def main(release: str, commit: str, crd_path: str, out_path: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    header = (
        f"# {crd['spec']['names']['kind']} (ray.io/v1): the openAPIV3Schema of KubeRay {release}\n"
        f"# ray-project/kuberay@{commit}\n"
        f"# ray-operator/config/crd/bases/{Path(crd_path).name}\n"
        "# without status, every pod template replaced by an open object (the tests validate\n"
        "# pod templates against Kubernetes' own schema). Written by trim_kuberay_crd.py.\n"
    )
    body = yaml.safe_dump(trimmed(schema), sort_keys=True, width=100)
    Path(out_path).write_text(header + body)


if __name__ == "__main__":
    main(*sys.argv[1:])
