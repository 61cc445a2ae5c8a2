#!/bin/sh
# otelcol's command line (--config=...) → rotel: OTLP/gRPC in on 0.0.0.0:4317, every span logged in detail,
# nothing forwarded (the compose file's collector config: an OTLP receiver and a `debug` exporter).
exec "$(/opt/rotel/bin/python -c 'import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), "rotel-agent"))')" \
  start --otlp-grpc-endpoint 0.0.0.0:4317 --otlp-http-endpoint 0.0.0.0:4318 \
  --exporter blackhole --debug-log traces --debug-log-verbosity detailed
