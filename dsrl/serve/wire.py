"""The protobuf half of the Tinker SDK 0.38 wire (tinker-protocol §2.8): forward/forward_backward
requests arrive as ``tinker_public.ForwardBackwardRequest`` and their results, like sampling
results, must go back as ``ForwardBackwardOutput`` / ``SampleResponse`` protos (a 0.38 client
rejects JSON for those two types).

The schema is declared here, in code, with only the messages and fields the server reads or
writes (a field of a newer SDK, unknown here, fails the request naming its number), in a private
descriptor pool: the server needs neither ``protoc`` nor the ``tinker`` package, and the SDK's
own ``tinker_public.proto`` can live in the same process without a name clash.

Decoding turns every inconsistency into a `UserError` that names the datum and the field, so
that the request fails alone and the server keeps serving."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from dsrl.serve.errors import UserError

PACKAGE = "tinker_public"

# DType enum (numbers fixed by the wire).
DTYPE_UNSPECIFIED, DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 0, 1, 2, 3, 4
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1

_F = descriptor_pb2.FieldDescriptorProto
_SCALAR = {"bytes": _F.TYPE_BYTES, "string": _F.TYPE_STRING, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
           "uint32": _F.TYPE_UINT32, "double": _F.TYPE_DOUBLE, "bool": _F.TYPE_BOOL}
_ENUMS = {"DType": {"DTYPE_UNSPECIFIED": 0, "DTYPE_FLOAT32": 1, "DTYPE_INT64": 2, "DTYPE_INT32": 3,
                    "DTYPE_BFLOAT16": 4},
          "StopReason": {"STOP_REASON_STOP": 0, "STOP_REASON_LENGTH": 1}}

# message -> [(field, number, type, repeated?, oneof)]; a type that is not a scalar names an
# enum or a message of the package; "map<string,X>" declares a map field.
_MESSAGES: Dict[str, list] = {
    "ForwardBackwardRequest": [("model_id", 1, "string", False, None), ("seq_id", 2, "int32", False, None),
                               ("data", 3, "Datum", True, None), ("loss_fn", 4, "string", False, None),
                               ("loss_fn_config", 5, "map<string,double>", True, None),
                               ("forward_only", 6, "bool", False, None),
                               ("loss_fn_config_v2", 7, "map<string,LossConfigValue>", True, None)],
    "LossConfigValue": [("number", 1, "double", False, "value"), ("text", 2, "string", False, "value")],
    "Datum": [("model_input", 1, "Chunk", True, None), ("loss_fn_inputs", 2, "map<string,Tensor>", True, None),
              ("model_input_spans", 3, "ProvenanceSpan", True, None),
              ("loss_fn_input_spans", 4, "ProvenanceSpan", True, None)],
    "ProvenanceSpan": [("prompt_tokens", 1, "PromptProvenanceSpan", False, "span"),
                       ("sampled_tokens", 2, "SampledProvenanceSpan", False, "span")],
    "PromptProvenanceSpan": [("sequence_id", 1, "string", False, None), ("offset", 2, "int64", False, None),
                             ("length", 3, "int64", False, None)],
    "SampledProvenanceSpan": [("sequence_id", 1, "string", False, None), ("offset", 2, "int64", False, None),
                              ("length", 3, "int64", False, None)],
    "Chunk": [("encoded_text", 1, "EncodedTextChunk", False, "chunk"), ("image", 2, "OpaqueChunk", False, "chunk"),
              ("dmel", 3, "OpaqueChunk", False, "chunk")],
    "EncodedTextChunk": [("tokens", 1, "bytes", False, None)],
    "OpaqueChunk": [],  # image / audio chunks: recognised only to reject them by name
    "Tensor": [("dense", 1, "bytes", False, "encoding"), ("sparse_csr", 2, "SparseCsr", False, "encoding"),
               ("dtype", 3, "DType", False, None), ("shape", 4, "int64", True, None)],
    "SparseCsr": [("values", 1, "bytes", False, None), ("crow_indices", 2, "bytes", False, None),
                  ("col_indices", 3, "bytes", False, None)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, "string", False, None),
                              ("loss_fn_outputs", 2, "ArrayRecord", True, None),
                              ("metrics", 3, "map<string,double>", True, None)],
    "ArrayRecord": [("type_tag", 1, "string", False, None), ("fields", 2, "map<string,BatchedTensor>", True, None),
                    ("num_datums", 3, "int64", False, None)],
    "BatchedTensor": [("data", 1, "bytes", False, None), ("offsets", 2, "bytes", False, None),
                      ("dtype", 3, "DType", False, None), ("trailing_shape", 4, "int64", True, None)],
    "SampleResponse": [("sequences", 1, "SampledSequence", True, None), ("prompt_logprobs", 2, "bytes", False, None),
                       ("prompt_cache_hit_tokens", 4, "int32", False, None)],
    "SampledSequence": [("stop_reason", 1, "StopReason", False, None), ("tokens", 2, "bytes", False, None),
                        ("logprobs", 3, "bytes", False, None)],
}


def _type_fields(f: descriptor_pb2.FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALAR:
        f.type = _SCALAR[type_name]
    elif type_name in _ENUMS:
        f.type = _F.TYPE_ENUM
        f.type_name = f".{PACKAGE}.{type_name}"
    else:
        f.type = _F.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{type_name}"


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="dsrl_tinker_wire.proto", package=PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        e = fd.enum_type.add(name=name)
        for vname, number in values.items():
            e.value.add(name=vname, number=number)
    for msg_name, fields in _MESSAGES.items():
        m = fd.message_type.add(name=msg_name)
        oneofs: List[str] = []
        for fname, number, ftype, repeated, oneof in fields:
            f = m.field.add(name=fname, number=number)
            f.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if ftype.startswith("map<"):
                key_t, val_t = ftype[4:-1].split(",")
                entry = m.nested_type.add(name="".join(p.capitalize() for p in fname.split("_")) + "Entry")
                entry.options.map_entry = True
                k = entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL)
                _type_fields(k, key_t)
                v = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
                _type_fields(v, val_t)
                f.type = _F.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{msg_name}.{entry.name}"
            else:
                _type_fields(f, ftype)
            if oneof is not None:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    m.oneof_decl.add(name=oneof)
                f.oneof_index = oneofs.index(oneof)
    return fd


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_build_file())


def _cls(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequestProto = _cls("ForwardBackwardRequest")
ForwardBackwardOutputProto = _cls("ForwardBackwardOutput")
SampleResponseProto = _cls("SampleResponse")

_NUMPY = {DTYPE_FLOAT32: np.dtype("<f4"), DTYPE_INT64: np.dtype("<i8"), DTYPE_INT32: np.dtype("<i4"),
          DTYPE_BFLOAT16: np.dtype("<u2")}
_DTYPE_NAMES = {DTYPE_UNSPECIFIED: "unspecified", DTYPE_FLOAT32: "float32", DTYPE_INT64: "int64",
                DTYPE_INT32: "int32", DTYPE_BFLOAT16: "bfloat16"}


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """One provenance claim: ``length`` positions of a datum field are positions
    ``[offset, offset + length)`` of sequence ``sequence_id``'s prompt (``sampled`` False) or
    sampled tokens (True)."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class WireDatum:
    """A decoded datum: N token ids and the per-token loss inputs (torch, CPU); its provenance
    spans, when it came with them, tiling model_input and target_tokens (field name -> spans)."""

    model_input: torch.Tensor
    loss_fn_inputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    spans: Dict[str, List[Span]] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    """A decoded ForwardBackwardRequest. ``error`` is set (and ``data`` empty) when the envelope
    (model_id, seq_id) was readable but the payload was not: the request must still consume its
    seq_id, as a failed future."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: Dict[str, object]
    forward_only: bool
    data: List[WireDatum]
    error: Optional[UserError] = None


def _decode_tensor(t, where: str, max_elements: int) -> torch.Tensor:
    np_dtype = _NUMPY.get(t.dtype)
    if np_dtype is None:
        raise UserError(f"{where}: unsupported dtype {_DTYPE_NAMES.get(t.dtype, t.dtype)} "
                        f"(expected float32 or int64)")
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise UserError(f"{where}: negative shape {shape}")
    if math.prod(shape) > max_elements:  # before any buffer of that size exists (sparse ones included)
        raise UserError(f"{where}: shape {shape} holds {math.prod(shape)} values, more than "
                        f"serve.max_datum_tokens={max_elements}")
    encoding = t.WhichOneof("encoding")
    if encoding == "sparse_csr":
        return _decode_csr(t.sparse_csr, np_dtype, t.dtype, shape, where)
    raw = t.dense if encoding == "dense" else b""
    if len(raw) % np_dtype.itemsize:
        raise UserError(f"{where}: {len(raw)} bytes is not a whole number of {_DTYPE_NAMES[t.dtype]} values")
    arr = np.frombuffer(raw, dtype=np_dtype)
    if shape:
        if math.prod(shape) != arr.size:
            raise UserError(f"{where}: shape {shape} needs {math.prod(shape)} values, the data has {arr.size}")
        arr = arr.reshape(shape)
    return _to_torch(arr, t.dtype)


def _decode_csr(csr, np_dtype, dtype: int, shape: List[int], where: str) -> torch.Tensor:
    if len(shape) != 2:
        raise UserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    try:
        values = np.frombuffer(csr.values, dtype=np_dtype)
        crow = np.frombuffer(csr.crow_indices, dtype="<i8")
        col = np.frombuffer(csr.col_indices, dtype="<i8")
    except ValueError as e:
        raise UserError(f"{where}: malformed sparse CSR buffers ({e})") from None
    if crow.size != rows + 1 or col.size != values.size or (crow.size and (crow[0] != 0 or crow[-1] != values.size)) \
            or np.any(np.diff(crow) < 0) or (col.size and (col.min() < 0 or col.max() >= cols)):
        raise UserError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros((rows, cols), dtype=np_dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return _to_torch(dense, dtype)


def _to_torch(arr: np.ndarray, dtype: int) -> torch.Tensor:
    if dtype == DTYPE_BFLOAT16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    elif dtype == DTYPE_INT32:
        arr = arr.astype(np.int64)
    return torch.from_numpy(np.array(arr))  # owned, writable copy


def _decode_datum(d, i: int, max_tokens: int) -> WireDatum:
    tokens: List[np.ndarray] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"datum {i}: model_input chunk {j} is {kind or 'empty'}; only encoded_text "
                            f"chunks are supported")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"datum {i}: model_input chunk {j}: {len(raw)} bytes is not a whole number of int32 tokens")
        tokens.append(np.frombuffer(raw, dtype="<i4"))
    ids = np.concatenate(tokens) if tokens else np.zeros((0,), dtype="<i4")
    if ids.size > max_tokens:
        raise UserError(f"datum {i}: model_input has {ids.size} tokens, more than serve.max_datum_tokens={max_tokens}")
    inputs = {key: _decode_tensor(t, f"datum {i}: loss_fn_inputs[{key!r}]", max_tokens)
              for key, t in d.loss_fn_inputs.items()}
    spans = _decode_spans(d, i, ids.size, inputs)
    return WireDatum(model_input=torch.from_numpy(ids.astype(np.int64)), loss_fn_inputs=inputs, spans=spans)


def _decode_spans(d, i: int, n_tokens: int, inputs: Dict[str, torch.Tensor]) -> Dict[str, List[Span]]:
    """The datum's provenance spans, checked for form: both lists or neither, each span one arm
    with a non-empty sequence_id and offset, length >= 0, each list tiling its field exactly."""
    given = {"model_input_spans": list(d.model_input_spans), "loss_fn_input_spans": list(d.loss_fn_input_spans)}
    if not any(given.values()):
        return {}
    if not all(given.values()):
        missing = [k for k, v in given.items() if not v][0]
        raise UserError(f"datum {i}: provenance comes as a pair, {missing} is missing")
    if "target_tokens" not in inputs:
        raise UserError(f"datum {i}: loss_fn_input_spans tile loss_fn_inputs['target_tokens'], which is missing")
    sizes = {"model_input_spans": n_tokens, "loss_fn_input_spans": int(inputs["target_tokens"].numel())}
    out = {}
    for name, raw in given.items():
        spans = []
        for j, sp in enumerate(raw):
            arm = sp.WhichOneof("span")
            if arm is None:
                raise UserError(f"datum {i}: {name}[{j}] is neither a prompt nor a sampled span")
            a = getattr(sp, arm)
            if not a.sequence_id or a.offset < 0 or a.length < 0:
                raise UserError(f"datum {i}: {name}[{j}] needs a sequence_id and offset, length >= 0 "
                                f"(got {a.sequence_id!r}, {a.offset}, {a.length})")
            spans.append(Span(arm == "sampled_tokens", a.sequence_id, int(a.offset), int(a.length)))
        total = sum(sp.length for sp in spans)
        if total != sizes[name]:
            field_name = "model_input" if name == "model_input_spans" else "loss_fn_inputs['target_tokens']"
            raise UserError(f"datum {i}: {name} cover {total} positions, {field_name} has {sizes[name]}")
        out[name] = spans
    return out


def _unknown_field(msg) -> Optional[int]:
    """The number of a field this schema does not know (a newer SDK's), if ``msg`` holds one."""
    from google.protobuf import unknown_fields

    for f in unknown_fields.UnknownFieldSet(msg):
        return int(f.field_number)
    return None


def _decode_config(msg) -> Dict[str, object]:
    """v2 (number or text) wins over the legacy numeric map, as the SDK intends."""
    out: Dict[str, object] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        kind = v.WhichOneof("value")
        if kind == "number":
            out[k] = float(v.number)
        elif kind == "text":
            out[k] = str(v.text)
    return out


def decode_forward_backward(body: bytes, *, max_datums: int, max_tokens: int) -> ForwardBackwardCall:
    """Parse a ForwardBackwardRequest. An unparseable body raises UserError (nothing of it can be
    trusted, not even the seq_id); a parseable one with a bad datum, more than `max_datums` datums
    or a datum over `max_tokens` comes back with ``error`` (checked before decoding any tensor)."""
    msg = ForwardBackwardRequestProto()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError, TypeError) as e:
        raise UserError(f"forward_backward: body is not a ForwardBackwardRequest protobuf ({e})") from None
    if not msg.model_id:
        raise UserError("forward_backward: model_id is missing")
    call = ForwardBackwardCall(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                               loss_fn_config=_decode_config(msg), forward_only=bool(msg.forward_only), data=[])
    try:
        unknown = _unknown_field(msg)
        if unknown is not None:
            raise UserError(f"forward_backward: the request sets field number {unknown}, which this server does not "
                            "know (a newer SDK than 0.38?); it is not run without it")
        for i, d in enumerate(msg.data):
            unknown = _unknown_field(d)
            if unknown is not None:
                raise UserError(f"datum {i}: sets field number {unknown}, which this server does not know "
                                "(a newer SDK than 0.38?)")
        if len(msg.data) > max_datums:
            raise UserError(f"forward_backward: {len(msg.data)} datums in one request, more than "
                            f"serve.max_chunk_datums={max_datums} (the SDK's fwdbwd_max_chunk_len)")
        call.data = [_decode_datum(d, i, max_tokens) for i, d in enumerate(msg.data)]
    except UserError as e:
        call.error = e
        call.data = []
    return call


# ---------------------------------------------------------------------------------------------
def encode_forward_backward_output(outputs: Sequence[Dict[str, torch.Tensor]], metrics: Dict[str, float]) -> bytes:
    """One ArrayRecord: per field, the datums' float32 arrays concatenated with int64 byte offsets."""
    msg = ForwardBackwardOutputProto(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    rec = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(out[name].detach().to(torch.float32).cpu().numpy(), dtype="<f4")
                  for out in outputs]
        trailing = list(arrays[0].shape[1:])
        if any(list(a.shape[1:]) != trailing for a in arrays):
            raise ValueError(f"output field {name!r}: datums differ in trailing shape")
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        bt = rec.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = DTYPE_FLOAT32
        bt.trailing_shape.extend(trailing)
    return msg.SerializeToString()


@dataclass
class SampledSequence:
    tokens: List[int]
    logprobs: List[float]
    stopped: bool  # True: ended on a stop token/string (STOP); False: ran out of tokens (LENGTH)


def encode_sample_response(sequences: Sequence[SampledSequence],
                           prompt_logprobs: Optional[Sequence[Optional[float]]]) -> bytes:
    """Per sequence: int32 tokens, float32 log-probs, stop reason; prompt log-probs as float32
    with NaN where none is defined (position 0), which the SDK turns into None."""
    msg = SampleResponseProto()
    for s in sequences:
        seq = msg.sequences.add(stop_reason=STOP_REASON_STOP if s.stopped else STOP_REASON_LENGTH)
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        vals = [float("nan") if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(vals, dtype="<f4").tobytes()
    return msg.SerializeToString()
