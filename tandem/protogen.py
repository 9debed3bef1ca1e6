"""Generate the Python gRPC code under tandem/v1 from protos/.

The generated files are committed; tests/test_protos.py regenerates them into a
temporary folder and fails when anything differs, so they never go stale.
Run `python -m tandem.protogen` after editing a .proto file.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("tandem/v1/*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # grpcio-tools is a development dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("generated", ", ".join(p.name for p in proto_files()))
