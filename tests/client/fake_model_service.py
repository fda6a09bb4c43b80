"""An in-process fake ModelService whose failures the test scripts, for client-only tests
(retries, metadata, deadlines) that need no model."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from protos import model_pb2, model_pb2_grpc


@dataclass
class Script:
    """What the fake does: fail the first ``fail_first`` calls of each method with
    ``fail_code`` before sending anything; ``fail_after_first_chunk`` makes Generate send one
    chunk, then fail with UNAVAILABLE; ``delay_s`` sleeps before answering."""

    fail_first: int = 0
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    fail_after_first_chunk: bool = False
    delay_s: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    metadata: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            n = self.calls.get(method, 0) + 1
            self.calls[method] = n
            self.metadata.append(dict(context.invocation_metadata()))
        if self.delay_s:
            time.sleep(self.delay_s)
        if n <= self.fail_first:
            context.abort(self.fail_code, f"scripted failure {n} of {method}")


class FakeModelService(model_pb2_grpc.ModelServiceServicer):
    WORDS = ("Hello", ",", " world", "!")

    def __init__(self, script: Script) -> None:
        self.script = script

    def Generate(self, request, context):  # noqa: N802
        self.script.enter("Generate", context)
        for i, word in enumerate(self.WORDS):
            last = i == len(self.WORDS) - 1
            yield model_pb2.GenerateResponse(
                request_id="fake-1",
                text=word,
                token_ids=[100 + i],
                finish_reason=model_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=model_pb2.Usage(prompt_tokens=3, completion_tokens=4) if last else None,
            )
            if self.script.fail_after_first_chunk:
                context.abort(grpc.StatusCode.UNAVAILABLE, "died mid-stream")

    def Tokenize(self, request, context):  # noqa: N802
        self.script.enter("Tokenize", context)
        return model_pb2.TokenizeResponse(token_ids=[1, 2], tokens=["a", "b"])

    def ModelInfo(self, request, context):  # noqa: N802
        self.script.enter("ModelInfo", context)
        return model_pb2.ModelInfoResponse(model_name="fake", block_size=16, num_blocks=8)


def start_fake(script: Script, port: int = 0) -> tuple[grpc.Server, str]:
    """Starts a fake on 127.0.0.1 (port 0: a free one); returns the server and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    model_pb2_grpc.add_ModelServiceServicer_to_server(FakeModelService(script), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{bound}"
