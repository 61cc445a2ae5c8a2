#!/usr/bin/env bash
# Regenerates the Python gRPC code under pdmesh/v1 from protos/pdmesh/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
out=pdmesh/v1
rm -f "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py
python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/pdmesh/v1/*.proto
touch "$out/__init__.py"
