#!/usr/bin/env bash
# Download, into .whl/, the wheels the H200 image lacks for serving (Python 3.12, x86_64): grpcio 1.85 and its
# health/reflection packages (the image's grpcio 1.84 is older than the generated code needs), FastAPI, uvicorn,
# pydantic, OpenTelemetry, googleapis-common-protos (google.rpc, the gateway's rich gRPC errors) and their
# dependencies. bench/h200_hot_path.sh installs whatever is in .whl/ into /tmp/site on the device; pass
# carry=[".whl"] to the device call. About 12 MB.
#
#   bash bench/h200_wheels.sh        # from the repo root, on the dev machine (it reaches PyPI)
#
# A serve that dies at start-up on the device with "No module named ..." names a wheel missing from this list
# (googleapis-common-protos was, 2026-12-03: one device call lost).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --dest .whl --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps \
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf googleapis-common-protos \
  fastapi annotated-doc starlette uvicorn h11 click anyio sniffio idna pydantic pydantic-core annotated-types \
  typing-inspection typing-extensions opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  importlib-metadata zipp lazy-importer prometheus-client httpx httpcore certifi
ls .whl | wc -l
du -sh .whl
