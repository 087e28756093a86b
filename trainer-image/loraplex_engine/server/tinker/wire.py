"""The Tinker SDK's binary wire: ``forward_backward`` requests (protobuf, optionally zstd
compressed) in, ``ForwardBackwardOutput`` and ``SampleResponse`` (protobuf) out.

The messages are the SDK's own (``tinker.proto.tinker_public_pb2``), so the server reads
exactly what the SDK writes: the ``tinker`` package is an engine runtime requirement
(requirements/engine.txt). Every check names the field at fault, as the SDK's request
spells it (``data[2].loss_fn_inputs.weights``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import get_args

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from loraplex_engine.server.tinker.provenance import DatumSpans, read_spans
from loraplex_engine.server.tinker.sampling_params import brief
from loraplex_engine.spec.errors import BodyTooLargeError, InvalidRequestError
from loraplex_engine.spec.training_service import (
    ClientDatum,
    ForwardOutput,
    LossCall,
    LossName,
    SampleOutput,
)

PROTOBUF = "application/x-protobuf"
# A forward_backward body's size once decompressed is bounded by the tokens a call may
# have (--max-step-tokens): a token costs 32 bytes on the wire (its int32 id, an int64
# target and five float32 inputs), twice that leaves room for each datum's framing; the
# slack is the SDK's own chunk size (fwdbwd_max_chunk_bytes_count, routes.py).
BYTES_PER_TOKEN = 64
BODY_SLACK_BYTES = 2 * 1024 * 1024
LOSSES: tuple[str, ...] = get_args(LossName)
# The SDK's loss names this engine does not implement: each answers a clear error.
UNSUPPORTED_LOSSES = {
    "custom": "server-side custom losses are not supported; the SDK runs "
    "forward_backward_custom on the client (this server answers custom_loss_server_side=false)",
}
RECORDED = "stable_reinforce"  # the loss that reads a datum's provenance
# loss_fn_inputs the engine reads, and the dtype each must have on the wire.
INPUT_DTYPES = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}
_PB_DTYPES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
_NUMPY = {"float32": np.float32, "int64": np.int64}
MASK_LOGPROB = -99999.0


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    forward_only: bool
    data: list[ClientDatum]
    loss: LossCall
    spans: list[DatumSpans | None]  # each datum's provenance (server/tinker/provenance.py)


def max_body_bytes(max_tokens: int) -> int:
    """The largest forward_backward body (decompressed) a call of ``max_tokens`` needs."""
    return BODY_SLACK_BYTES + BYTES_PER_TOKEN * max_tokens


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """The body, decompressed as it streams and stopped past ``max_bytes``: a small
    zstd frame that expands to gigabytes is refused having produced ``max_bytes``."""
    if len(body) > max_bytes:
        raise BodyTooLargeError(f"the body is over the limit of {max_bytes} bytes")
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise InvalidRequestError(f"Content-Encoding {brief(encoding)}: only zstd is accepted")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise InvalidRequestError(f"the zstd body does not decompress: {e}") from None
    if len(out) > max_bytes:
        raise BodyTooLargeError(
            f"the body decompresses to over the limit of {max_bytes} bytes "
            "(what --max-step-tokens tokens take on the wire)"
        )
    return out


def _tensor(msg: pb.Tensor, name: str, n_tokens: int, where: str) -> np.ndarray:
    field = f"{where}.loss_fn_inputs.{name}"
    dtype = _PB_DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
            " is not a TensorData dtype (float32 or int64)",
            field=f"{field}.dtype",
        )
    expected = INPUT_DTYPES.get(name)
    if expected is not None and dtype != expected:
        raise InvalidRequestError(f"dtype {dtype}; {name} must be {expected}", f"{field}.dtype")
    if msg.HasField("sparse_csr"):
        raise InvalidRequestError("sparse tensors are not accepted here", field=field)
    raw = msg.dense
    if len(msg.shape) > 1 or len(raw) > 8 * n_tokens:  # before copying it
        raise InvalidRequestError(
            f"shape {brief(list(msg.shape))}; expected [{n_tokens}] (one value per input token)",
            field=f"{field}.shape",
        )
    itemsize = np.dtype(_NUMPY[dtype]).itemsize
    if len(raw) % itemsize:
        raise InvalidRequestError(f"{len(raw)} bytes is not a whole number of {dtype}", field)
    arr = np.frombuffer(raw, dtype=_NUMPY[dtype]).copy()
    shape = list(msg.shape) if msg.shape else [arr.size]
    if shape != [n_tokens] or arr.size != n_tokens:
        raise InvalidRequestError(
            f"shape {brief(shape)} with {arr.size} values; expected [{n_tokens}] "
            "(one value per input token)",
            field=f"{field}.shape",
        )
    if dtype == "float32" and not np.all(np.isfinite(arr)):
        raise InvalidRequestError("values must be finite", field=field)
    return arr


def _tokens(datum: pb.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"{kind or 'empty'} chunks are not supported (text tokens only)",
                field=f"{where}.model_input.chunks[{j}]",
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise InvalidRequestError(
                "tokens are not int32", field=f"{where}.model_input.chunks[{j}]"
            )
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    if not tokens:
        raise InvalidRequestError("no input tokens", field=f"{where}.model_input")
    if min(tokens) < 0:
        raise InvalidRequestError("negative token id", field=f"{where}.model_input")
    return tokens


def loss_call(name: str, config: dict[str, float]) -> LossCall:
    if name in UNSUPPORTED_LOSSES:
        raise InvalidRequestError(UNSUPPORTED_LOSSES[name], field="loss_fn")
    if name not in LOSSES:
        raise InvalidRequestError(
            f"unknown loss_fn {brief(name)}; this engine implements {', '.join(LOSSES)}",
            field="loss_fn",
        )
    return LossCall(name, dict(config))  # type: ignore[arg-type]


def _config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    out: dict[str, float] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise InvalidRequestError(
                    "text values are not accepted (numbers only)",
                    field=f"loss_fn_config.{key}",
                )
            out[key] = float(value.number)
    else:
        out = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in out.items():
        if not math.isfinite(value):
            raise InvalidRequestError("must be finite", field=f"loss_fn_config.{key}")
    return out


def _count_tokens(msg: pb.ForwardBackwardRequest, max_tokens: int) -> None:
    """The call's token count, from the chunks' byte lengths: checked before any list of
    Python ints is built (a list costs 36 bytes a token, the wire 4)."""
    count = sum(
        len(chunk.encoded_text.tokens) // 4
        for datum in msg.data
        for chunk in datum.model_input
        if chunk.WhichOneof("chunk") == "encoded_text"
    )
    if count > max_tokens:
        raise InvalidRequestError(
            f"{count} tokens; a call takes at most {max_tokens} (--max-step-tokens)",
            field="forward_backward_input.data",
        )


def read_forward_backward(body: bytes, max_tokens: int) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # google.protobuf's DecodeError
        raise InvalidRequestError(f"not a ForwardBackwardRequest protobuf: {e}") from None
    if not msg.model_id:
        raise InvalidRequestError("model_id is required", field="model_id")
    loss = loss_call(msg.loss_fn, _config(msg))
    if not msg.data:
        raise InvalidRequestError("no data", field="forward_backward_input.data")
    _count_tokens(msg, max_tokens)
    data, spans = [], []
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = _tokens(datum, where)
        inputs = {
            name: _tensor(t, name, len(tokens), where) for name, t in datum.loss_fn_inputs.items()
        }
        if "target_tokens" not in inputs:
            raise InvalidRequestError(
                "target_tokens is required", field=f"{where}.loss_fn_inputs.target_tokens"
            )
        data.append(ClientDatum(input_ids=tokens, loss_inputs=inputs))
        # provenance is read only for the loss that trains on it (server/tinker/stability.py)
        spans.append(read_spans(datum, len(tokens), where) if loss.name == RECORDED else None)
    seq = int(msg.seq_id)
    return ForwardBackwardCall(msg.model_id, seq, bool(msg.forward_only), data, loss, spans)


def metric_name(key: str) -> str:
    """The SDK reduces chunked metrics by the part after ``:`` (``loss:sum``); a name
    without one is reported as a mean, extra colons become ``_``."""
    name, sep, reduction = key.rpartition(":")
    if not sep:
        return f"{key}:mean"
    return f"{name.replace(':', '_')}:{reduction}"


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    floats = all(a.dtype.kind == "f" for a in arrays)
    dtype = np.float32 if floats else np.int64
    parts = [np.ascontiguousarray(np.asarray(a).reshape(-1), dtype=dtype) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.nbytes for p in parts], out=offsets[1:])
    return pb.BatchedTensor(
        data=b"".join(p.tobytes() for p in parts),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32 if floats else pb.DTYPE_INT64,
    )


def forward_output_proto(out: ForwardOutput) -> bytes:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[metric_name(key)] = float(value)
    if out.outputs:
        names = sorted({name for row in out.outputs for name in row})
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(out.outputs))
        for name in names:
            if all(name in row for row in out.outputs):
                record.fields[name].CopyFrom(_batched([row[name] for row in out.outputs]))
    return msg.SerializeToString()


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j] = tok
            lps[i, j] = lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def sample_output_proto(out: SampleOutput, topk: int, topk_sampled: int = 0) -> bytes:
    msg = pb.SampleResponse()
    for row in out.rows:
        seq = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if row.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(row.token_ids, dtype=np.int32).tobytes(),
            logprobs=np.asarray(row.logprobs, dtype=np.float32).tobytes(),
        )
        if topk_sampled > 0 and row.top_logprobs is not None:
            rows: list[list[tuple[int, float]] | None] = list(row.top_logprobs)
            seq.topk_sampled_logprobs.CopyFrom(_topk(rows, topk_sampled))
    if out.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in out.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if out.topk_prompt_logprobs is not None and topk > 0:
        msg.topk_prompt_logprobs.CopyFrom(_topk(out.topk_prompt_logprobs, topk))
    return msg.SerializeToString()
