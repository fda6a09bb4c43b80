#!/bin/sh
# radixkv container entry point.
#   radixkv-entrypoint cache_service|model_service|router [ARGS...]  ->  exec python -m NAME ARGS...
#   radixkv-entrypoint health [PORT]   grpc.health.v1 Check (service "") of 127.0.0.1:PORT; PORT
#       defaults to $HEALTH_PORT, else the --port of the running server (PID 1), else 50051.
#       Over TLS when HEALTH_TLS_CA is set (mutual with HEALTH_TLS_CERT + HEALTH_TLS_KEY;
#       HEALTH_TLS_SERVER_NAME: the name the server's certificate is checked against).
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
    exec python -c 'import os, sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
target = "127.0.0.1:" + sys.argv[1]
ca = os.environ.get("HEALTH_TLS_CA")
if ca:  # the server speaks TLS (mutual when HEALTH_TLS_CERT/KEY are given)
    def read(name):
        path = os.environ.get(name)
        return open(path, "rb").read() if path else None
    creds = grpc.ssl_channel_credentials(read("HEALTH_TLS_CA"), read("HEALTH_TLS_KEY"), read("HEALTH_TLS_CERT"))
    name = os.environ.get("HEALTH_TLS_SERVER_NAME")
    channel = grpc.secure_channel(target, creds, [("grpc.ssl_target_name_override", name)] if name else None)
else:
    channel = grpc.insecure_channel(target)
try:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
except grpc.RpcError as error:
    sys.exit("health: " + error.code().name)
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
