"""infra/k8s: every RayCluster / RayJob manifest validates against KubeRay's v1 CRD schemas (plus a strict check
for unknown fields, which the API server would silently prune), every RayJob entrypoint is a `python -m pipeline`
command this version's CLI parses (configs and --set keys included), and the Dockerfile's Ray and torch match the
manifests and the set-up script.

The schemas are KubeRay's CustomResourceDefinitions, found through ``$FOVEATE_KUBERAY_SCHEMAS`` (default
``../shared/schemas/kuberay``); the schema tests skip with a reason where that folder is absent.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "infra" / "k8s"
SCHEMAS = Path(os.environ.get("FOVEATE_KUBERAY_SCHEMAS", REPO.parent / "shared" / "schemas" / "kuberay"))
CRDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}


def _documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _schema(kind: str) -> dict:
    path = SCHEMAS / CRDS[kind]
    if not path.is_file():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS} (set FOVEATE_KUBERAY_SCHEMAS)")
    return _load_schema(str(path))


@functools.cache
def _load_schema(path: str) -> dict:
    crd = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def unknown_fields(doc, schema, where: str = "") -> list[str]:
    """Keys of ``doc`` that ``schema`` does not declare, where it declares its properties and does not preserve
    unknown fields (what ``kubectl apply --validate=strict`` reports)."""
    out: list[str] = []
    if isinstance(doc, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{where}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields") and extra is not True:
                out.append(f"{where}.{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            out += unknown_fields(item, schema["items"], f"{where}[{i}]")
    return out


def validate(doc: dict) -> list[str]:
    """Schema errors and unknown fields of one RayCluster / RayJob manifest (empty: valid)."""
    import jsonschema

    schema = _schema(doc["kind"])
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    return errors + [f"unknown field {f}" for f in unknown_fields(doc, schema)]


def _ray_docs() -> list[tuple[str, dict]]:
    return [(name, doc) for name, doc in _documents() if doc.get("kind") in CRDS]


def test_manifests_exist():
    kinds = sorted(doc["kind"] for _, doc in _ray_docs())
    assert kinds.count("RayCluster") == 1 and kinds.count("RayJob") == 3, kinds
    commands = {shlex.split(doc["spec"]["entrypoint"])[3] for _, doc in _ray_docs() if doc["kind"] == "RayJob"}
    assert commands == {"ingest", "train", "score"}


@pytest.mark.parametrize("name,doc", _ray_docs(), ids=[f"{n}:{d['metadata']['name']}" for n, d in _ray_docs()])
def test_manifest_validates_against_kuberay_v1(name, doc):
    assert doc["apiVersion"] == "ray.io/v1"
    assert validate(doc) == [], name
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert spec["authOptions"]["mode"] == "token"  # Ray token authentication stays on


def test_the_validator_rejects_broken_manifests():
    """The checks above can fail: a wrong type, an unknown (misspelt) field, a bad enum value."""
    (job,) = [doc for _, doc in _ray_docs() if doc["metadata"]["name"] == "foveate-train"]
    bad = copy.deepcopy(job)
    bad["spec"]["backoffLimit"] = "two"
    assert any("backoffLimit" in e for e in validate(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["entrypointt"] = bad["spec"].pop("entrypoint")
    assert "unknown field .spec.entrypointt" in validate(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resourcez"] = {}
    assert any("resourcez" in e for e in validate(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert any("authOptions" in e for e in validate(bad))


@pytest.mark.parametrize(
    "doc",
    [doc for _, doc in _ray_docs() if doc["kind"] == "RayJob"],
    ids=[doc["metadata"]["name"] for _, doc in _ray_docs() if doc["kind"] == "RayJob"],
)
def test_rayjob_entrypoint_is_a_command_of_this_version(doc):
    from pipeline.cli import build_parser
    from pipeline.config import load_config, resolve_config_path

    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "pipeline"], argv
    try:
        args = build_parser().parse_args(argv[3:])
    except SystemExit as err:  # argparse's way of saying no
        pytest.fail(f"{doc['metadata']['name']}: the CLI rejects {argv[3:]} (exit {err.code})")
    if argv[3] == "train":
        from pipeline.train import TrainConfig

        cfg = load_config(TrainConfig, resolve_config_path(args.config), args.overrides)
        assert cfg.workers >= 1 and cfg.data.stores.startswith("s3://") and cfg.workdir.startswith("s3://")
        if cfg.use_gpu:  # a GPU per Ray Train worker: the job's cluster must have that many GPUs
            gpus = sum(
                int(g["replicas"])
                * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
                for g in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
            )
            assert gpus >= cfg.workers, (gpus, cfg.workers)
    # stores, runs and predictions are on object storage; the only local paths (slides) are on the volume the
    # pods mount
    values = argv[4:] + [a.split("=", 1)[1] for a in argv if "=" in a]
    paths = [a for a in values if a.startswith("/")]
    assert all(p.startswith("/data/") for p in paths), paths
    assert any(a.startswith("s3://foveate/stores") for a in values), values
    # every pod of the job gets the object store's credentials
    spec = doc["spec"]["rayClusterSpec"]
    for pod in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        refs = [e.get("secretRef", {}).get("name") for e in pod["spec"]["containers"][0].get("envFrom", [])]
        assert "foveate-s3" in refs, doc["metadata"]["name"]


def test_dockerfile_matches_the_manifests_and_setup():
    import ray

    text = (K8S / "Dockerfile").read_text()
    image_ray = re.search(r"ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311", text).group(1)
    assert image_ray == ray.__version__
    for _, doc in _ray_docs():
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        assert spec["rayVersion"] == image_ray
    torch_pin = re.search(r'"torch==([0-9.]+)"', (REPO / "infra" / "setup.sh").read_text()).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in text
    assert "COPY dist/foveate-*.whl" in text  # installed from the wheel, not from a source tree
