"""gRPC (grpc.aio): InferenceService, grpc.health.v1.Health and server reflection (v1 and v1alpha).

Cancelling a Generate call or letting its deadline pass cancels the handler; the stream's
`aclose` then aborts the engine request, which frees its KV-cache blocks. Health reports
NOT_SERVING until the model is loaded, while draining, and for good once the engine dies.
Every request field is read; fields this server's messages do not define (a client built from a
newer .proto) are refused with INVALID_ARGUMENT naming their numbers, unless the server runs with
--allow-unknown-fields (request_fields.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pagedinfer.engine.config import ServerConfig
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.outputs import FinishReason, RequestOutput
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.server.auth import ApiKeyAuth, bearer_token
from pagedinfer.engine.server.errors import ErrorKind, classify
from pagedinfer.engine.server.generation import (
    ChatMessage,
    GenerationRequest,
    GenerationService,
    PromptInput,
    finish_reason_value,
)
from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc
from pagedinfer.engine.server.structured_fields import structured_from_pb

logger = logging.getLogger("pagedinfer.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
DEFAULT_MAX_TOKENS = 16

_STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
_FINISH = {
    FinishReason.STOP.value: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH.value: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT.value: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR.value: pb.FINISH_REASON_ERROR,
}
_OPTIONAL_FIELDS = (
    "n",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "skip_special_tokens",
    "use_speculation",
)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    return SamplingParams(
        max_tokens=max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias),
        structured_output=structured_from_pb(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
        **kwargs,
    )


def unknown_field_paths(msg: Message, path: str = "") -> list[str]:
    """Fields of `msg` (and the messages set in it) that its descriptor does not define, as
    "path.#number" (protobuf keeps them as unknown fields; they would be ignored)."""
    out = [f"{path}#{f.field_number}" for f in unknown_fields.UnknownFieldSet(msg)]
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        items = value if field.is_repeated else [value]
        for i, item in enumerate(items):
            where = f"{path}{field.name}[{i}]." if field.is_repeated else f"{path}{field.name}."
            out += unknown_field_paths(item, where)
    return out


def prompt_from_pb(request: pb.GenerateRequest | pb.TokenizeRequest) -> PromptInput:
    which = request.WhichOneof("input")
    if which in ("prompt", "text"):
        return PromptInput(text=getattr(request, which))
    if which == "prompt_token_ids":
        return PromptInput(token_ids=tuple(request.prompt_token_ids.ids))
    if which == "chat":
        messages = tuple(
            ChatMessage(
                "system" if m.role == "developer" else m.role,
                m.content,
                m.name if m.HasField("name") else None,
            )
            for m in request.chat.messages
        )
        return PromptInput(messages=messages)
    raise InvalidRequestError("set one of: prompt, prompt_token_ids, chat")


def response_to_pb(out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id, finished=out.finished)
    for d in out.deltas:
        delta = msg.deltas.add(index=d.index, text=d.text, token_ids=d.token_ids, error=d.error or "")
        if d.finish_reason is not None:
            delta.finish_reason = _FINISH.get(finish_reason_value(d.finish_reason), pb.FINISH_REASON_STOP)
        if d.stop_reason is not None:
            delta.stop_reason = str(d.stop_reason)
        for lp in d.logprobs or ():
            pos = delta.logprobs.add()
            pos.sampled.CopyFrom(
                pb.TokenLogprob(
                    token_id=lp.sampled.token_id, token=lp.sampled.token, logprob=lp.sampled.logprob
                )
            )
            for t in lp.top:
                pos.top.add(token_id=t.token_id, token=t.token, logprob=t.logprob)
    if out.usage is not None:
        u = out.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                draft_tokens=u.draft_tokens,
                accepted_draft_tokens=u.accepted_draft_tokens,
            )
        )
    if out.timing is not None:
        t = out.timing
        msg.timing.CopyFrom(
            pb.Timing(
                queue_time_seconds=t.queue_time,
                time_to_first_token_seconds=t.time_to_first_token,
                decode_time_seconds=t.decode_time,
                e2e_latency_seconds=t.e2e_latency,
                tokens_per_second=t.tokens_per_second,
            )
        )
    return msg


@dataclass(frozen=True)
class MalformedRequest:
    """What a request that is not valid protobuf deserializes to (answered INVALID_ARGUMENT)."""

    error: str


def _lenient(message_cls: type) -> Callable[[bytes], Any]:
    # grpc answers INTERNAL when a deserializer raises; malformed input is the client's error.
    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return MalformedRequest(f"malformed {message_cls.DESCRIPTOR.name} protobuf: {e}")

    return deserialize


async def _reject_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


async def _abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    err = classify(exc)
    if err.kind is ErrorKind.INTERNAL:
        logger.exception("internal error in gRPC handler", exc_info=exc)
    if err.retry_after_seconds:
        context.set_trailing_metadata((("retry-after", str(err.retry_after_seconds)),))
    await context.abort(_STATUS[err.kind], err.message)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, service: GenerationService, allow_unknown_fields: bool = False) -> None:
        self.service = service
        self.allow_unknown_fields = allow_unknown_fields

    async def _check_request(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Malformed protobuf, or fields this server does not define: INVALID_ARGUMENT."""
        await _reject_malformed(request, context)
        unknown = unknown_field_paths(request)
        if not unknown:
            return
        if not self.allow_unknown_fields:
            names = ", ".join(unknown)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown fields (by number): {names}; this server does not read them",
            )
        logger.info("accepted unknown request fields (--allow-unknown-fields): %s", ", ".join(unknown))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await self._check_request(request, context)
        try:
            gen_request = GenerationRequest(
                prompt=prompt_from_pb(request),
                sampling_params=sampling_from_pb(request.sampling),
                priority=request.priority,
                request_id=request.request_id or None,
                model=request.model or None,
            )
            stream = await self.service.open(gen_request)
        except Exception as e:  # mapped to a status code; never a crash
            await _abort_with(context, e)
            return
        try:
            async for out in stream:
                yield response_to_pb(out)
        except Exception as e:  # e.g. the engine stopped mid-stream: a status, not UNKNOWN
            await _abort_with(context, e)
        finally:
            await stream.aclose()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        await self._check_request(request, context)
        try:
            engine = self.service.handle.require_engine()
            prompt = prompt_from_pb(request)
            ids = self.service.prompt_token_ids(engine, prompt, add_special_tokens=request.add_special_tokens)
        except Exception as e:
            await _abort_with(context, e)
            raise AssertionError("unreachable") from e  # context.abort raises
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=int(engine.max_model_len))

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        await self._check_request(request, context)
        try:
            text = self.service.detokenize(list(request.token_ids), request.skip_special_tokens)
        except Exception as e:
            await _abort_with(context, e)
            raise AssertionError("unreachable") from e
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await self._check_request(request, context)
        try:
            engine = self.service.handle.require_engine()
        except Exception as e:
            await _abort_with(context, e)
            raise AssertionError("unreachable") from e
        mc, cfg = engine.model_config, self.service.handle.config
        return pb.ModelInfo(
            served_model_name=self.service.served_model_name,
            model=cfg.model,
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            max_model_len=int(engine.max_model_len),
            num_layers=mc.num_layers,
            hidden_size=mc.hidden_size,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            device=str(getattr(engine, "device", cfg.device.device)),
            dtype=str(getattr(engine, "dtype", cfg.device.dtype)),
        )


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <key>` metadata on InferenceService methods."""

    def __init__(self, auth: ApiKeyAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)  # health and reflection stay open
        metadata = dict(details.invocation_metadata or ())
        if self.auth.check_token(bearer_token(metadata.get("authorization"))):
            return await continuation(details)
        handler = await continuation(details)
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or invalid API key (metadata authorization: Bearer ...)"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=des, response_serializer=ser)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=des, response_serializer=ser)


def _service_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Like the generated add_..._to_server, but with deserializers that never raise."""
    unary_stream, unary_unary = grpc.unary_stream_rpc_method_handler, grpc.unary_unary_rpc_method_handler
    handlers = {
        "Generate": unary_stream(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": unary_unary(
            servicer.Tokenize,
            request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "Detokenize": unary_unary(
            servicer.Detokenize,
            request_deserializer=_lenient(pb.DetokenizeRequest),
            response_serializer=pb.DetokenizeResponse.SerializeToString,
        ),
        "GetModelInfo": unary_unary(
            servicer.GetModelInfo,
            request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Server reflection as v1alpha (grpcio-reflection) and as v1, which grpcurl tries first:
    v1's messages are v1alpha's under another package (same fields, same wire format), so the
    one servicer answers both."""
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


class GrpcServer:
    """The gRPC side of one server process. `is_reuse_port`: one of several API servers on the
    port the launcher reserved (api_servers.reserve_grpc_port); a lone server binds without
    SO_REUSEPORT (gRPC's default is on), so a second server on its port fails to bind."""

    def __init__(
        self, service: GenerationService, config: ServerConfig, auth: ApiKeyAuth, is_reuse_port: bool = False
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", int(is_reuse_port)),
        ]
        interceptors = [_AuthInterceptor(auth)] if auth.enabled else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        servicer = InferenceServicer(service, config.allow_unknown_fields)
        self.server.add_generic_rpc_handlers((_service_handler(servicer),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        service.handle.on_death(lambda: self.set_serving(False))  # the engine died while serving
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
            REFLECTION_V1,
        )
        _enable_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {config.host}:{config.grpc_port}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_seconds: float) -> None:
        await self.server.stop(grace_seconds)
