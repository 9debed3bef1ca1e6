"""The committed generated gRPC code must equal what protoc generates now."""

from __future__ import annotations

from tandem.protogen import REPO, generate


def test_generated_code_is_fresh(tmp_path):
    generate(tmp_path)
    fresh = sorted((tmp_path / "tandem" / "v1").glob("*_pb2*"))
    assert fresh, "protoc generated nothing"
    stale = [p.name for p in fresh if (REPO / "tandem" / "v1" / p.name).read_bytes() != p.read_bytes()]
    missing = [p.name for p in fresh if not (REPO / "tandem" / "v1" / p.name).exists()]
    assert not missing and not stale, (
        f"generated code is stale ({stale}) or missing ({missing}): run `python -m tandem.protogen`")
