#!/bin/sh
# radixkv container entry point.
#   radixkv-entrypoint cache_service|model_service|router [ARGS...]  ->  exec python -m NAME ARGS...
#   radixkv-entrypoint health [PORT]   grpc.health.v1 Check (service "") of 127.0.0.1:PORT; PORT
#       defaults to $HEALTH_PORT, else the --port of the running server (PID 1), else 50051.
#   radixkv-entrypoint kv_mirror [ARGS...]  ->  python -m examples.kv_mirror
set -eu

command="${1:---help}"
[ "$#" -gt 0 ] && shift

case "$command" in
  cache_service|model_service|router)
    exec python -m "$command" "$@"
    ;;
  kv_mirror)
    exec python -m examples.kv_mirror "$@"
    ;;
  health)
    port="${1:-${HEALTH_PORT:-}}"
    if [ -z "$port" ] && [ -r /proc/1/cmdline ]; then
      port="$(tr '\0' '\n' < /proc/1/cmdline | sed -n '/^--port$/{n;p;q}')"
      if [ -z "$port" ]; then
        port="$(tr '\0' '\n' < /proc/1/cmdline | sed -n 's/^--port=//p' | head -n 1)"
      fi
    fi
    exec python -c 'import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel("127.0.0.1:" + sys.argv[1])
reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)' "${port:-50051}"
    ;;
  -h|--help|help)
    echo "usage: radixkv-entrypoint {cache_service|model_service|router|kv_mirror|health} [ARGS...]"
    ;;
  *)
    echo "radixkv-entrypoint: unknown command '$command' (cache_service, model_service, router, kv_mirror, health)" >&2
    exit 2
    ;;
esac
