"""Rendering deploy/kubernetes for tests: `kubectl kustomize`, or the base alone without it.

Also what the tests need to read a rendered set: pod templates of the workloads
(Deployments and LeaderWorkerSets) and the tandem service a container runs.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from dataclasses import dataclass

import yaml

from tests.services import REPO

KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
RENDERABLE = ["base", *OVERLAYS]


def kubectl_missing() -> str | None:
    return None if shutil.which("kubectl") else "kubectl is not installed (it renders the kustomizations)"


def render(name: str) -> list[dict]:
    """Render base or overlays/NAME with kubectl; without kubectl, only the base (see below)."""
    path = KUBE / "base" if name == "base" else KUBE / "overlays" / name
    if kubectl_missing():
        if name != "base":
            raise LookupError(kubectl_missing())
        return render_base_without_kustomize()
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_base_without_kustomize() -> list[dict]:
    """The base's resources with its image tag and labels applied: what kustomize would give.

    Only the transformations the base uses (resources, images.newTag, labels
    without selectors); anything else there is refused rather than ignored.
    """
    k = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "images", "labels"}
    if unknown:
        raise NotImplementedError(f"the kustomize-free renderer does not do {sorted(unknown)}")
    tags = {i["name"]: i["newTag"] for i in k.get("images", [])}
    labels = {key: v for entry in k.get("labels", []) for key, v in entry["pairs"].items()}
    docs = []
    for res in k["resources"]:
        for d in yaml.safe_load_all((KUBE / "base" / res).read_text()):
            if not d:
                continue
            d["metadata"].setdefault("labels", {}).update(labels)
            for pod in pod_templates([d]).values():
                for c in pod["spec"]["containers"]:
                    if c["image"] in tags:
                        c["image"] = f"{c['image']}:{tags[c['image']]}"
            docs.append(d)
    return docs


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Workload name -> its pod template (Deployments; a LeaderWorkerSet's worker template)."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            out[d["metadata"]["name"]] = d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            # The leader pod (it serves gRPC), with the labels the LWS controller gives it.
            lwt = d["spec"]["leaderWorkerTemplate"]
            pod = copy.deepcopy(lwt.get("leaderTemplate") or lwt["workerTemplate"])
            pod["metadata"].setdefault("labels", {}).update({
                "leaderworkerset.sigs.k8s.io/name": d["metadata"]["name"],
                "leaderworkerset.sigs.k8s.io/worker-index": "0"})
            out[d["metadata"]["name"]] = pod
    return out


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


@dataclass(frozen=True)
class TandemContainer:
    """A container that runs a tandem service, with its flags parsed by that service's own parser."""

    workload: str
    pod: dict
    container: dict
    service: str  # target | draft | gateway
    flags: object  # argparse.Namespace

    def ports(self) -> dict[str, int]:
        """Port name -> number, as the container declares them."""
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}

    def listening(self) -> dict[str, int]:
        """What the flags make the process listen on, named as the manifests name ports."""
        f = self.flags
        if self.service == "gateway":
            return {"http": f.port, "grpc": f.grpc_port}
        ports = {"grpc": f.port}
        if self.service == "draft" and f.metrics_port is not None:
            ports["metrics"] = f.metrics_port
        return ports


def parser_for(service: str):
    if service == "target":
        from target_service.server import build_parser
    elif service == "draft":
        from draft_service.server import build_parser
    elif service == "gateway":
        from gateway.main import build_parser
    else:
        raise AssertionError(f"no tandem service {service!r}")
    return build_parser()


def tandem_containers(docs: list[dict]) -> list[TandemContainer]:
    out = []
    for workload, pod in pod_templates(docs).items():
        for c in pod["spec"]["containers"]:
            assert "command" not in c, f"{workload}: the image's entry point (tandem) must run, not {c['command']}"
            service, *argv = c["args"]
            try:
                flags = parser_for(service).parse_args(argv)
            except SystemExit:
                raise AssertionError(f"{workload}: `tandem {service}` refuses {argv}") from None
            out.append(TandemContainer(workload, pod, c, service, flags))
    return out


def by_service(docs: list[dict], service: str) -> TandemContainer:
    found = [c for c in tandem_containers(docs) if c.service == service]
    assert len(found) == 1, f"expected one {service} container, found {len(found)}"
    return found[0]
