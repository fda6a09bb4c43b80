"""gRPC ModelService: validates requests, translates proto <-> engine objects, streams outputs,
aborts requests by id and reports the replica's load.

Callers are kept apart by their principal (common.auth.current_principal(); one anonymous caller
without --auth-token-file): request ids are the caller's own (model_service/request_ids.py), and a
token limited by ns= may only Generate in its namespaces."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from common.auth import current_principal, one_role
from common.grpc_server import end_call
from common.limits import MAX_CHOICES, MAX_LOGPROBS, RequestLimits, quote_id, request_limit_error
from model_service.detokenizer import IncrementalDetokenizer
from model_service.engine import Engine, GenerationOutput
from model_service.logprobs import TokenTexts
from model_service.loop_relay import LoopRelay
from model_service.model_loader import LoadedModel
from model_service.request import FinishReason, Request, RequestStatus
from model_service.request_ids import DuplicateRequestError
from model_service.sampler import SamplingOptions, make_generator
from model_service.scheduler import QueueFullError
from model_service.structured import GrammarCompiler, Guide, spec_from_proto
from protos import model_pb2, model_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128

# The role a bearer token needs for each method under --auth-token-file (common/auth.py).
METHOD_ROLES: dict[str, str] = one_role(model_pb2.DESCRIPTOR.services_by_name["ModelService"], "client")

_FINISH_REASONS = {
    FinishReason.STOP: model_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: model_pb2.FINISH_REASON_ABORT,
    FinishReason.CANCELLED: model_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: model_pb2.FINISH_REASON_ABORT,
}


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class ServingInfo:
    """What the servicer needs to know about the deployment besides the model."""

    block_size: int
    num_blocks: int
    dtype: str
    device: str
    attention_backend: str
    cache_addr: str
    worker_id: str
    serving_addr: str = ""  # where clients reach this replica (known once the port is bound)

    @property
    def pool_capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, engine: Engine, loaded: LoadedModel, info: ServingInfo,
                 limits: RequestLimits | None = None) -> None:
        self.limits = limits if limits is not None else RequestLimits()
        self.engine = engine
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.info = info
        self._relay: LoopRelay | None = None  # engine thread -> the server's event loop
        # The structured-output compiler takes ~0.3 s to build from the vocabulary: built on a thread
        # of its own at start-up, so no request waits for it on the event loop.
        self._grammars: Future[GrammarCompiler] = Future()
        threading.Thread(target=self._build_grammars, name="radixkv-grammars", daemon=True).start()
        self._token_texts = TokenTexts(self.tokenizer)  # for log probabilities

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request: model_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        try:
            owner = _caller_key(request.namespace)
            engine_request = self._build_request(request, arrival, owner)
        except InvalidRequest as e:
            end_call(context, e.code, str(e))
            return
        request_id = engine_request.client_request_id  # echoed; the engine may run it under another
        outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        relay = self._relay_for(asyncio.get_running_loop())
        try:
            self.engine.submit(engine_request, lambda out: relay.put(outputs, out))
        except DuplicateRequestError as e:
            end_call(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
            return
        except QueueFullError as e:
            end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        log.info("request %s: %d prompt tokens, max_tokens %d", engine_request.log_id,
                 len(engine_request.prompt_token_ids), engine_request.max_tokens)
        open_choices = len(engine_request.group)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if out.error:
                    finished = True
                    end_call(context, grpc.StatusCode.UNAVAILABLE if out.finish_reason is FinishReason.ABORT
                             else grpc.StatusCode.INTERNAL, out.error)
                    return
                open_choices -= out.finish_reason is not None
                finished = open_choices == 0
                yield _response(request_id, out, self.info.serving_addr, self._token_texts)
        finally:
            if not finished:  # client cancelled, disconnected or its deadline passed
                self.engine.cancel(engine_request)

    def _relay_for(self, loop: asyncio.AbstractEventLoop) -> LoopRelay:
        if self._relay is None or self._relay.loop is not loop:
            self._relay = LoopRelay(loop)
            self.engine.output_batch = self._relay.batch  # a step's outputs: one wake-up of the loop
        return self._relay

    def _check_limits(self, request: model_pb2.GenerateRequest | model_pb2.TokenizeRequest) -> None:
        why = request_limit_error(request, self.limits)
        if why is not None:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, why)

    def _build_request(self, request: model_pb2.GenerateRequest, arrival: float, owner: str) -> Request:
        self._check_limits(request)
        prompt_ids = self._prompt_token_ids(request)
        sampling = request.sampling
        try:
            options = SamplingOptions.from_params(
                temperature=sampling.temperature if sampling.HasField("temperature") else None,
                top_p=sampling.top_p if sampling.HasField("top_p") else None,
                top_k=sampling.top_k,
                seed=sampling.seed if sampling.HasField("seed") else None,
                min_p=sampling.min_p,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else None,
                logit_bias=sampling.logit_bias,  # at most MAX_LOGIT_BIAS entries: bounded work per step
                min_tokens=sampling.min_tokens,
            )
        except ValueError as e:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if any(s == "" for s in sampling.stop):
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "stop strings must not be empty")
        self._check_vocab(sampling.stop_token_ids, "stop_token_ids")
        self._check_vocab(sorted(options.logit_bias), "logit_bias")
        max_tokens = self._max_tokens(sampling, len(prompt_ids))
        if sampling.HasField("max_tokens") and options.min_tokens > max_tokens:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"min_tokens ({options.min_tokens}) must be <= max_tokens ({max_tokens})")
        logprobs = sampling.logprobs if sampling.HasField("logprobs") else None
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        prompt_logprobs = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
        n = sampling.n or 1
        if n > MAX_CHOICES:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"n must be in [1, {MAX_CHOICES}], got {n}")
        client_id = request.request_id or uuid.uuid4().hex
        choices = []
        for index in range(n):
            seed = None if options.seed is None else (options.seed + index) % 2**64  # choice i: seed + i
            choices.append(Request(
                # The client's id when given (a router aborts by it), unique among the caller's live
                # requests; Engine.submit picks the ids the choices run under (request_ids.py).
                request_id=client_id,
                client_request_id=client_id,
                owner=owner,
                prompt_token_ids=prompt_ids,
                sampling=options,
                max_tokens=max_tokens,
                stop_token_ids=frozenset(sampling.stop_token_ids),
                namespace=request.namespace,
                ignore_eos=sampling.ignore_eos,
                arrival_time=arrival,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, list(sampling.stop)),
                generator=make_generator(seed, self.loaded.model.device),
                guide=self._guide(sampling.structured_output) if sampling.HasField("structured_output") else None,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if index == 0 else None,
                index=index,
                status=RequestStatus.WAITING if index == 0 else RequestStatus.FORKING,
            ))
        if n > 1:
            for choice in choices:
                choice.choices = choices
        return choices[0]

    def _guide(self, message: model_pb2.StructuredOutput) -> Guide | None:
        """The request's structured output matcher; INVALID_ARGUMENT when it does not compile."""
        try:
            spec = spec_from_proto(message)
            if spec is None:
                return None
            return self._grammars.result().compile(spec)
        except ValueError as e:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"structured_output: {e}") from e

    def _build_grammars(self) -> None:
        try:
            self._grammars.set_result(GrammarCompiler(self.tokenizer, self.loaded.vocab_size,
                                                      self.loaded.eos_token_ids))
        except Exception as e:  # every structured request then fails with this error
            log.exception("building the structured-output compiler failed")
            self._grammars.set_exception(e)

    def _max_tokens(self, sampling: model_pb2.SamplingParams, num_prompt: int) -> int:
        """The request's max_tokens. The model's context is checked before the pool: a request the
        model can never take is INVALID_ARGUMENT; one only this pool is too small for is
        RESOURCE_EXHAUSTED."""
        context_limit = self.loaded.max_context_tokens
        pool_limit = self.info.pool_capacity_tokens
        if num_prompt >= context_limit:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"prompt has {num_prompt} tokens; the model's context is {context_limit} tokens")
        if sampling.HasField("max_tokens"):
            max_tokens = sampling.max_tokens
            if max_tokens <= 0:
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be > 0, got {max_tokens}")
            if num_prompt + max_tokens > context_limit:
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                                     f"model's context of {context_limit} tokens")
        if num_prompt >= pool_limit:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"prompt has {num_prompt} tokens; the whole KV pool holds {pool_limit} tokens")
        if not sampling.HasField("max_tokens"):
            return min(DEFAULT_MAX_TOKENS, context_limit - num_prompt, pool_limit - num_prompt)
        if num_prompt + max_tokens > pool_limit:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the KV pool "
                                 f"of {pool_limit} tokens")
        return max_tokens

    def _prompt_token_ids(self, request: model_pb2.GenerateRequest | model_pb2.TokenizeRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind in ("prompt", "text"):
            text = getattr(request, kind)
            if not text:
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = list(self.tokenizer(text).input_ids)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            self._check_vocab(ids, "token_ids")
        elif kind == "chat":
            messages = [_chat_message(m) for m in request.chat.messages]
            if not messages:
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "chat has no messages")
            if self.tokenizer.chat_template is None:
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "this model has no chat template")
            tools = _chat_tools(request.chat.tools_json)
            try:
                ids = list(self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True).input_ids)
            except Exception as e:  # template errors (unknown role ...) are the caller's input
                raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {e}") from e
        else:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, token_ids or chat is required")
        if not ids:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        return ids

    def _check_vocab(self, ids, field: str) -> None:
        vocab = self.loaded.vocab_size
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{field} contains {bad}, outside the vocabulary [0, {vocab})")

    # ------------------------------------------------------------------ Tokenize, Detokenize, ModelInfo

    async def Tokenize(self, request: model_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            self._check_limits(request)
            ids = self._prompt_token_ids(request)
        except InvalidRequest as e:
            return end_call(context, e.code, str(e))
        return model_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    async def Detokenize(self, request: model_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        """The ids' text as the tokenizer decodes them (special tokens included, as vLLM's
        /detokenize does), so that Tokenize then Detokenize gives the text back."""
        ids = list(request.token_ids)
        try:
            self._check_vocab(ids, "token_ids")
        except InvalidRequest as e:
            return end_call(context, e.code, str(e))
        return model_pb2.DetokenizeResponse(text=self.tokenizer.decode(ids))

    async def ModelInfo(self, request: model_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        config = self.loaded.model.config
        return model_pb2.ModelInfoResponse(
            model_name=self.loaded.name,
            model_fingerprint=self.loaded.fingerprint,
            vocab_size=self.loaded.vocab_size,
            max_context_tokens=self.loaded.max_context_tokens,
            eos_token_ids=self.loaded.eos_token_ids,
            dtype=self.info.dtype,
            device=self.info.device,
            attention_backend=self.info.attention_backend,
            block_size=self.info.block_size,
            num_blocks=self.info.num_blocks,
            pool_id=self.engine.cache.pool_id or self.info.worker_id,
            cache_addr=self.info.cache_addr,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
            serving_addr=self.info.serving_addr,
        )

    # ------------------------------------------------------------------ Abort, GetLoad

    async def Abort(self, request: model_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            return end_call(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        # Only the caller's own requests: another caller's id gets the answer of an unknown one.
        if not self.engine.abort(_caller_key(None), request.request_id):
            return end_call(context, grpc.StatusCode.NOT_FOUND,
                            f"no live request with id {quote_id(request.request_id)} (unknown or already finished)")
        log.info("request %s: abort requested", request.request_id)
        return model_pb2.AbortResponse()

    async def GetLoad(self, request: model_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        load = self.engine.load
        return model_pb2.GetLoadResponse(
            num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests,
            num_waiting_tokens=load.num_waiting_tokens,
            kv_usage=load.kv_usage,
            num_blocks=load.num_blocks,
            num_free_blocks=load.num_free_blocks,
            prefix_hit_rate=load.prefix_hit_rate,
            prompt_tokens=load.prompt_tokens,
            cached_prompt_tokens=load.cached_prompt_tokens,
            serving_addr=self.info.serving_addr,
            pool_id=self.engine.cache.pool_id or self.info.worker_id,
        )


def _caller_key(namespace: str | None) -> str:
    """The calling principal's key ("" without --auth-token-file). With a `namespace` to use,
    raises InvalidRequest(PERMISSION_DENIED) when the caller's token may not use it (the message
    names only that namespace, never those the token may use)."""
    principal = current_principal()
    if principal is None:
        return ""
    if namespace is not None and not principal.may_read(namespace):  # ns= of the token line
        raise InvalidRequest(grpc.StatusCode.PERMISSION_DENIED,
                             f"this token may not use namespace {quote_id(namespace)}")
    return principal.key


def _response(request_id: str, out: GenerationOutput, served_by: str, texts: TokenTexts) -> model_pb2.GenerateResponse:
    response = model_pb2.GenerateResponse(request_id=request_id, text=out.text, token_ids=out.token_ids,
                                          index=out.index)
    for field, positions in ((response.logprobs, out.logprobs), (response.prompt_logprobs, out.prompt_logprobs)):
        for position in positions or ():
            entry = field.add(chosen=_token_logprob(texts, position.token_id, position.logprob, position.rank))
            entry.top.extend(_token_logprob(texts, t, lp, rank) for rank, (t, lp) in enumerate(position.top, 1))
    if out.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[out.finish_reason]
        response.matched_stop = out.matched_stop
        u = out.usage
        response.usage.CopyFrom(model_pb2.Usage(
            prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens,
            completion_tokens=u.completion_tokens, time_to_first_token=u.time_to_first_token,
            total_time=u.total_time, num_preemptions=u.num_preemptions,
            miss_evicted_tokens=u.miss_evicted_tokens, miss_other_replica_tokens=u.miss_other_replica_tokens,
            miss_new_tokens=u.miss_new_tokens,  # miss_other_namespace_tokens: deprecated, always 0
            cached_device_tokens=(u.cached_prompt_tokens - u.cached_host_tokens - u.cached_disk_tokens
                                  - u.cached_peer_tokens),
            cached_host_tokens=u.cached_host_tokens, cached_disk_tokens=u.cached_disk_tokens,
            cached_peer_tokens=u.cached_peer_tokens,
            served_by=served_by))
    return response


def _token_logprob(texts: TokenTexts, token_id: int, logprob: float, rank: int) -> model_pb2.TokenLogprob:
    text, raw = texts.get(token_id)
    return model_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token=text, token_bytes=raw, rank=rank)


def _chat_message(message: model_pb2.ChatMessage) -> dict:
    """A ChatMessage as the chat template takes it: tool calls with their arguments as objects."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls_json:
        try:
            calls = json.loads(message.tool_calls_json)
        except ValueError as e:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"chat tool_calls_json is not JSON: {e}") from None
        if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                 for c in calls)):
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                 "chat tool_calls_json must be a JSON list of {\"function\": {...}} objects")
        for c in calls:
            arguments = c["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    c["function"] = {**c["function"], "arguments": json.loads(arguments)}
                except ValueError:
                    pass  # not JSON: the template gets the string as it is
        out["tool_calls"] = calls
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _chat_tools(tools_json: str) -> list[dict] | None:
    """ChatMessages.tools_json as the chat template's `tools` (None without)."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as e:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"chat tools_json is not JSON: {e}") from None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "chat tools_json must be a JSON list of objects")
    return tools
