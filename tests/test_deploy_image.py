"""The image definition (deploy/Dockerfile) against the manifests that run it.

No container registry is reachable from the machines that run these tests, so
the image is never built here: its Dockerfile is parsed and checked for what the
manifests rely on (entry point, exposed ports, the non-root user, the code and
models it holds, the cpu/gpu variants).
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass

import pytest

from tandem.cli import COMMANDS
from tests.deploy_render import RENDERABLE, pod_templates, render, tandem_containers
from tests.services import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    name: str  # upper case: FROM, RUN, COPY, ...
    value: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order: continuation lines joined, comment lines dropped (as Docker does)."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        name, _, value = full.partition(" ")
        out.append(Instruction(name.upper(), value.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def one(instructions: list[Instruction], name: str) -> str:
    found = [i.value for i in instructions if i.name == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict]]:
    out = {}
    for name in RENDERABLE:
        try:
            out[name] = render(name)
        except LookupError:
            continue  # no kubectl: the base only (rendered without kustomize)
    return out


def test_the_parser_joins_continued_lines_and_skips_comments():
    got = parse_dockerfile("# c\nFROM x\nRUN a \\\n  # inner\n  && b\nUSER 1:1\n")
    assert got == [Instruction("FROM", "x"), Instruction("RUN", "a && b"), Instruction("USER", "1:1")]


def test_the_entry_point_is_the_tandem_command_and_every_container_runs_one_of_its_services(dockerfile, manifests):
    entry = json.loads(one(dockerfile, "ENTRYPOINT"))  # exec form: signals reach tandem itself
    assert entry == ["tandem"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tandem"] == "tandem.cli:main"
    assert json.loads(one(dockerfile, "CMD"))[0] in COMMANDS  # the default: tandem serve
    for name, docs in manifests.items():
        for c in tandem_containers(docs):  # also: no `command` overrides the entry point
            assert c.service in COMMANDS and c.service in ("target", "draft", "gateway"), name


def test_the_image_exposes_exactly_the_ports_the_manifests_use(dockerfile, manifests):
    exposed = {int(p.split("/")[0]) for i in dockerfile if i.name == "EXPOSE" for p in i.value.split()}
    used = {p["containerPort"] for docs in manifests.values() for pod in pod_templates(docs).values()
            for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert used and exposed == used


def test_the_image_runs_as_the_non_root_user_the_pods_require(dockerfile, manifests):
    user = one(dockerfile, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, "USER must be a numeric non-root id"
    run = " ".join(i.value for i in dockerfile if i.name == "RUN")
    assert re.search(rf"useradd[^&;]*--uid {uid}\b", run) and re.search(rf"groupadd[^&;]*--gid {gid}\b", run)
    users = [i for i in dockerfile if i.name == "USER"]
    assert dockerfile.index(users[-1]) > max(dockerfile.index(i) for i in dockerfile if i.name == "RUN")
    for name, docs in manifests.items():
        for workload, pod in pod_templates(docs).items():
            ctx = pod["spec"]["securityContext"]
            assert ctx["runAsNonRoot"] is True, f"{name}/{workload}"
            assert (ctx["runAsUser"], ctx["runAsGroup"]) == (int(uid), int(gid)), f"{name}/{workload}"
            for c in pod["spec"]["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def test_the_image_holds_every_package_and_the_demo_models_the_base_points_at(dockerfile, manifests):
    workdir = one(dockerfile, "WORKDIR")
    copies = {}
    for i in dockerfile:
        if i.name == "COPY" and not i.value.startswith("--from"):
            *sources, dest = i.value.split()
            for src in sources:
                copies[src] = dest.replace("./", f"{workdir}/", 1) if dest.startswith("./") else dest
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        pkg = pattern.rstrip("*")
        assert pkg in copies, f"the image lacks the package {pkg}"
    for src in copies:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for src in copies:
        assert not any(fnmatch.fnmatch(src, pat) or src.startswith(pat.rstrip("/") + "/") for pat in ignored), src
    # Paths the manifests pass that live in the image (not on a mounted volume) must be copied there.
    in_image = {dest for dest in copies.values()}
    for name, docs in manifests.items():
        for c in tandem_containers(docs):
            for path in (getattr(c.flags, "model", None), getattr(c.flags, "target_model", None)):
                if path and path.startswith(workdir):
                    assert path in in_image, f"{name}: {c.workload} reads {path}, which the image does not hold"


def test_the_variant_argument_picks_cpu_or_gpu_torch_and_the_overlays_use_the_matching_tag(dockerfile, manifests):
    assert "VARIANT=cpu" in [i.value for i in dockerfile if i.name == "ARG"]
    run = " ".join(i.value for i in dockerfile if i.name == "RUN")
    assert "download.pytorch.org/whl/cpu" in run and "VARIANT must be cpu or gpu" in run
    for name, docs in manifests.items():
        for c in tandem_containers(docs):
            repo, _, tag = c.container["image"].rpartition(":")
            assert repo == "tandem-serve" and tag in ("cpu", "gpu"), f"{name}: {c.container['image']}"
            gpus = int(c.container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
            assert tag == ("gpu" if name.startswith("gpu") else "cpu") and (gpus == 0 or tag == "gpu"), name


def test_the_gpu_image_builds_the_lanes_c_spin_where_the_services_look_for_it(dockerfile):
    """The spin's helper is built at image build time (the pods' root filesystem is read-only), into the
    directory the services' TANDEM_CACHE_DIR names, before the image drops to its non-root user."""
    envs = [i.value for i in dockerfile if i.name == "ENV"]
    cache = [value.partition("=")[2] for value in envs if value.startswith("TANDEM_CACHE_DIR=")]
    assert cache == ["/opt/tandem/native"]
    build = [i for i in dockerfile if i.name == "RUN" and "native_waiter()" in i.value]
    assert len(build) == 1 and '"$VARIANT" = gpu' in build[0].value
    env_at = next(n for n, i in enumerate(dockerfile) if i.name == "ENV" and i.value.startswith("TANDEM_CACHE_DIR="))
    user_at = max(n for n, i in enumerate(dockerfile) if i.name == "USER")
    assert env_at < dockerfile.index(build[0]) < user_at
    run = " ".join(i.value for i in dockerfile if i.name == "RUN")
    assert "gcc" in run  # the gpu variant's compiler (Triton's too) builds it
