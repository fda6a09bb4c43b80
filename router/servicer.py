"""radixkv.v1.ModelService served by the router: a thin layer over RouterCore that maps its
RouterError to the same gRPC status, the call's deadline to the core's clock, and hands it the
caller's principal (request ids, Abort and namespaces are the caller's own)."""

from __future__ import annotations

import time

import grpc

from common.auth import current_principal, one_role
from common.grpc_server import end_call
from protos import model_pb2, model_pb2_grpc
from router.core import RouterCore
from router.errors import RouterError

# The role a bearer token needs for each method under --auth-token-file (common/auth.py).
METHOD_ROLES: dict[str, str] = one_role(model_pb2.DESCRIPTOR.services_by_name["ModelService"], "client")


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _end(context: grpc.aio.ServicerContext, error: RouterError) -> None:
    end_call(context, grpc.StatusCode[error.code], error.message)


class RouterServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(self, request: model_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async for message in self.core.generate(request, _deadline(context), current_principal()):
                yield message
        except RouterError as e:
            _end(context, e)

    async def Tokenize(self, request: model_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.tokenize(request, _deadline(context))
        except RouterError as e:
            _end(context, e)

    async def Detokenize(self, request: model_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.detokenize(request, _deadline(context))
        except RouterError as e:
            _end(context, e)

    async def ModelInfo(self, request: model_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.model_info(_deadline(context))
        except RouterError as e:
            _end(context, e)

    async def Abort(self, request: model_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.abort(request.request_id, _deadline(context), current_principal())
        except RouterError as e:
            _end(context, e)

    async def GetLoad(self, request: model_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.get_load(_deadline(context))
        except RouterError as e:
            _end(context, e)
