"""The Kubernetes manifests: they render, validate against Kubernetes 1.30, and are wired as the services expect.

Built-in kinds are validated strictly (unknown fields fail) against the 1.30 JSON
schemas that `kubernetes-validate` bundles; the custom resources (ServiceMonitor,
ScaledObject, LeaderWorkerSet) have no schema there, so their required fields are
checked here, and a LeaderWorkerSet's pod template is validated as a v1 PodTemplate.
Every container's args are parsed by the real parser of the service it runs, so a
renamed or missing flag fails here.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from draft_service.metrics_http import SEQUENCES
from gateway.discovery import SourceKind, parse_draft_source, split_host_port
from tests.deploy_render import (
    KUBE,
    OVERLAYS,
    RENDERABLE,
    by_service,
    kubectl_missing,
    named,
    of_kind,
    pod_templates,
    render,
    render_base_without_kustomize,
    tandem_containers,
)

K8S_VERSION = "1.30.0"
CRD_KINDS = {"ServiceMonitor", "ScaledObject", "LeaderWorkerSet"}


@pytest.fixture(scope="module", params=RENDERABLE)
def rendered(request) -> tuple[str, list[dict]]:
    try:
        return request.param, render(request.param)
    except LookupError as exc:
        pytest.skip(f"{exc}; the base is still checked, rendered without kustomize")


def test_there_are_cpu_gpu_keda_and_multinode_overlays():
    assert {"cpu-demo", "gpu", "gpu-keda", "gpu-multinode"} <= set(OVERLAYS)


def test_kubectl_renders_here_or_the_test_says_why_not():
    if kubectl_missing():
        pytest.skip(kubectl_missing())
    assert render("cpu-demo")


# --- schemas ------------------------------------------------------------------------------------------

def check_crd(doc: dict) -> None:
    """Required fields of the custom resources we use (their CRDs are not in the 1.30 schemas)."""
    kind, spec = doc["kind"], doc.get("spec") or {}
    assert doc["metadata"].get("name"), doc
    if kind == "ServiceMonitor":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"]
        assert spec["endpoints"] and all("port" in e or "targetPort" in e for e in spec["endpoints"])
    elif kind == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"]["name"]
        assert spec["triggers"] and all(t["type"] and t["metadata"] for t in spec["triggers"])
        assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
    elif kind == "LeaderWorkerSet":
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        lwt = spec["leaderWorkerTemplate"]
        assert isinstance(lwt["size"], int) and lwt["size"] >= 1
        assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in ("RecreateGroupOnPodRestart", "None")
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt or key == "workerTemplate":
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": "t"}, "template": lwt[key]},
                                             K8S_VERSION, strict=True)
    else:
        raise AssertionError(f"no check for custom resource {kind}")


def test_every_object_validates_against_kubernetes_1_30(rendered):
    name, docs = rendered
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            check_crd(doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}") from None


def test_the_schema_check_catches_a_misspelt_field():
    dep = copy.deepcopy(named(render("base"), "Deployment", "tandem-draft"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50053}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


# --- wiring ---------------------------------------------------------------------------------------------

def test_containers_declare_exactly_the_ports_their_flags_listen_on_and_listen_beyond_loopback(rendered):
    _, docs = rendered
    containers = tandem_containers(docs)
    assert {c.service for c in containers} == {"target", "draft", "gateway"}
    for c in containers:
        assert c.ports() == c.listening(), f"{c.workload}: declares {c.ports()}, listens on {c.listening()}"
        assert c.flags.host in ("0.0.0.0", "::"), f"{c.workload} listens on {c.flags.host} only"


def test_liveness_readiness_and_startup_probes_ask_grpc_health_on_the_grpc_port(rendered):
    _, docs = rendered
    for c in tandem_containers(docs):
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            p = c.container.get(probe)
            assert p is not None, f"{c.workload} has no {probe}"
            assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{c.workload} {probe}: {p}"
            assert p["grpc"]["port"] == c.listening()["grpc"]
            # The overall status every tandem server sets; the gateway's liveness asks the name that
            # stays SERVING while it waits for a lost target or drains (gateway/main.py).
            want = "tandem.liveness" if (c.service, probe) == ("gateway", "livenessProbe") else ""
            assert p["grpc"].get("service", "") == want, f"{c.workload} {probe}: {p}"


def test_each_service_selects_one_workload_and_routes_to_ports_it_declares(rendered):
    _, docs = rendered
    pods = pod_templates(docs)
    for svc in of_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matches = [w for w, pod in pods.items() if sel.items() <= pod["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {svc['metadata']['name']} selects {matches}"
        declared = {p["name"]: p["containerPort"] for c in pods[matches[0]]["spec"]["containers"]
                    for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in declared or target in declared.values(), f"{svc['metadata']['name']}: {port}"


def test_the_gateway_reaches_the_target_by_service_name_and_the_drafts_through_a_headless_service(rendered):
    _, docs = rendered
    gw, target, draft = (by_service(docs, s) for s in ("gateway", "target", "draft"))
    host, port = split_host_port(gw.flags.target)
    svc = named(docs, "Service", host)
    assert port in [p["port"] for p in svc["spec"]["ports"]]
    assert svc["spec"]["selector"].items() <= target.pod["metadata"]["labels"].items()

    source = parse_draft_source(gw.flags.draft, gw.flags.draft_resolve_interval)
    assert source.kind == SourceKind.DNS
    headless = named(docs, "Service", source.host)
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
    assert headless["spec"]["selector"].items() <= draft.pod["metadata"]["labels"].items()
    # Every address of the name is a pod IP, so the port must be the one the pods listen on.
    assert source.port == draft.listening()["grpc"]


def test_the_draft_autoscaler_scales_the_draft_deployment_on_the_metric_the_draft_serves(rendered):
    name, docs = rendered
    draft = by_service(docs, "draft")
    assert draft.flags.metrics_port is not None and draft.ports()["metrics"] == draft.flags.metrics_port
    hpas, scaled = of_kind(docs, "HorizontalPodAutoscaler"), of_kind(docs, "ScaledObject")
    assert len(hpas) + len(scaled) == 1, f"{name}: one autoscaler for the drafts, not {len(hpas) + len(scaled)}"
    scaler = (hpas or scaled)[0]
    ref = scaler["spec"]["scaleTargetRef"]
    assert (ref.get("kind", "Deployment"), ref["name"]) == ("Deployment", draft.workload)
    if hpas:
        [m] = scaler["spec"]["metrics"]
        assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == SEQUENCES
        rules = yaml.safe_load((KUBE / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
        assert any(r["name"]["as"] == SEQUENCES and SEQUENCES in r["seriesQuery"] for r in rules)
    else:
        [trigger] = scaler["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and SEQUENCES in trigger["metadata"]["query"]


def test_service_monitors_scrape_the_gateway_and_draft_metrics_ports(rendered):
    name, docs = rendered
    monitors = of_kind(docs, "ServiceMonitor")
    if name in ("base", "cpu-demo"):
        assert not monitors  # these must apply on a cluster without the Prometheus Operator CRDs
        return
    scraped = {}
    for m in monitors:
        svcs = [s for s in of_kind(docs, "Service")
                if m["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(svcs) == 1, f"ServiceMonitor {m['metadata']['name']} selects {len(svcs)} Services"
        [endpoint] = m["spec"]["endpoints"]
        [port] = [p for p in svcs[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
        scraped[svcs[0]["metadata"]["name"]] = (port["targetPort"], endpoint["path"])
    gw, draft = by_service(docs, "gateway"), by_service(docs, "draft")
    assert scraped == {"tandem-gateway": ("http", "/metrics"), "tandem-draft": ("metrics", "/metrics")}
    assert gw.ports()["http"] == gw.flags.port and draft.ports()["metrics"] == draft.flags.metrics_port


def test_every_workload_has_a_disruption_budget_and_drafts_leave_one_at_a_time(rendered):
    _, docs = rendered
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for workload, pod in pod_templates(docs).items():
        mine = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()]
        assert len(mine) == 1, f"{workload} is covered by {len(mine)} PodDisruptionBudgets"
        if workload == by_service(docs, "draft").workload:
            assert mine[0]["spec"]["maxUnavailable"] == 1


def test_gpu_overlays_give_the_target_as_many_gpus_as_tp_ranks_and_each_draft_one(rendered):
    name, docs = rendered
    for c in tandem_containers(docs):
        gpus = int(c.container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        if not name.startswith("gpu"):
            assert gpus == 0 and c.service == "gateway" or c.flags.device == "cpu"
            continue
        if c.service == "target":
            assert c.flags.device == "cuda" and gpus == c.flags.tp >= 1
        elif c.service == "draft":
            assert c.flags.device == "cuda" and gpus == 1
        else:
            assert gpus == 0  # the gateway needs none


def test_the_multinode_target_is_one_leader_worker_group_behind_the_target_service():
    if kubectl_missing():
        pytest.skip(kubectl_missing())
    docs = render("gpu-multinode")
    assert not [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "tandem-target"]
    [lws] = of_kind(docs, "LeaderWorkerSet")
    svc = named(docs, "Service", "tandem-target")
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # One pod per group until the target can join TP ranks across pods (deploy/README.md says so).
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1


def test_the_kustomize_free_render_of_the_base_equals_kubectls():
    if kubectl_missing():
        pytest.skip(kubectl_missing())

    def key(d: dict) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    assert sorted(render_base_without_kustomize(), key=key) == sorted(render("base"), key=key)
