#!/bin/sh
# radixkv container entry point.
#   radixkv-entrypoint cache_service|model_service|router [ARGS...]  ->  exec python -m NAME ARGS...
#   radixkv-entrypoint health [PORT]   grpc.health.v1 Check (service "") of 127.0.0.1:PORT; PORT
#       defaults to $HEALTH_PORT, else the --port of the running server (PID 1), else 50051.
#       Over TLS when HEALTH_TLS_CA is set (mutual with HEALTH_TLS_CERT + HEALTH_TLS_KEY;
#       HEALTH_TLS_SERVER_NAME: the name the server's certificate is checked against).
#   radixkv-entrypoint kv_mirror [ARGS...]  ->  python -m examples.kv_mirror
#   radixkv-entrypoint make-tokens DIR [ARGS...]  ->  python -m scripts.make_tokens (fresh token files)
#
# Tokens: when RADIXKV_TOKEN_DIR is set (deploy/k8s and docker-compose.yml set it), a server gets
# its token files from that directory, in the layout scripts/make_tokens.py writes:
#   server-tokens -> --auth-token-file       (every server)
#   cache-token   -> --cache-token-file      (model_service, router)
#   replica-token -> --replica-token-file    (router)
# A flag given on the command line wins; a file the server needs that is missing or unreadable
# stops it (exit 2) rather than let it serve, or call upstream, without a token.
set -eu

# has_flag FLAG ARGS...: whether ARGS give FLAG ("FLAG VALUE" or "FLAG=VALUE")
has_flag() {
  flag="$1"
  shift
  for arg in "$@"; do
    case "$arg" in
      "$flag"|"$flag"=*) return 0 ;;
    esac
  done
  return 1
}

# need FILE: FILE is readable, or stop
need() {
  if [ ! -r "$1" ] || [ ! -f "$1" ]; then
    echo "radixkv-entrypoint: RADIXKV_TOKEN_DIR=$RADIXKV_TOKEN_DIR but $1 is missing or unreadable" \
         "(tokens are required; scripts/make_tokens.py writes them)" >&2
    exit 2
  fi
}

command="${1:---help}"
[ "$#" -gt 0 ] && shift

case "$command" in
  cache_service|model_service|router)
    if [ -n "${RADIXKV_TOKEN_DIR:-}" ]; then
      dir="${RADIXKV_TOKEN_DIR%/}"
      if ! has_flag --auth-token-file "$@"; then
        need "$dir/server-tokens"
        set -- "$@" --auth-token-file "$dir/server-tokens"
      fi
      if [ "$command" != cache_service ] && ! has_flag --cache-token-file "$@"; then
        need "$dir/cache-token"
        set -- "$@" --cache-token-file "$dir/cache-token"
      fi
      if [ "$command" = router ] && ! has_flag --replica-token-file "$@"; then
        need "$dir/replica-token"
        set -- "$@" --replica-token-file "$dir/replica-token"
      fi
    fi
    exec python -m "$command" "$@"
    ;;
  make-tokens)
    exec python -m scripts.make_tokens "$@"
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
    echo "usage: radixkv-entrypoint {cache_service|model_service|router|kv_mirror|make-tokens|health} [ARGS...]"
    ;;
  *)
    echo "radixkv-entrypoint: unknown command '$command' (cache_service, model_service, router, kv_mirror, make-tokens, health)" >&2
    exit 2
    ;;
esac
