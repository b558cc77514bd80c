"""Minimal, dependency-free safetensors reader/writer (numpy + optional torch).

File layout (https://github.com/huggingface/safetensors):
    8 bytes   : u64 little-endian N = length of the JSON header
    N bytes   : UTF-8 JSON  {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                             "__metadata__": {str: str}}   (metadata optional)
    rest      : raw little-endian tensor data; offsets are relative to the start of this buffer.

The writer pads the header with spaces to a multiple of 8 bytes (as the reference
implementation does) and lays tensors out in the order they were given.
"""

import json
import struct

import numpy as np

# safetensors dtype string -> numpy little-endian dtype. BF16 has no numpy type:
# it is stored/loaded as raw uint16 and converted to/from float32 explicitly.
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def _bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x):
    """float32 -> bfloat16 bit pattern, round-to-nearest-even (NaN kept quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FC0
    return out


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    return n, header


def load(path):
    """Returns (tensors: dict name -> numpy array, metadata: dict or {}).

    BF16 tensors are returned as float32 arrays."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    buf = memoryview(raw)[8 + n:]
    metadata = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        dt = info["dtype"]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = info["data_offsets"]
        if dt == "BF16":
            bits = np.frombuffer(buf[begin:end], dtype=np.dtype("<u2"))
            arr = _bf16_bits_to_f32(bits)
        else:
            if dt not in _DTYPES:
                raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
            arr = np.frombuffer(buf[begin:end], dtype=_DTYPES[dt])
        count = int(np.prod(shape)) if shape else 1
        if arr.size != count:
            raise ValueError(f"{path}: tensor {name}: {arr.size} elements, shape {shape}")
        out[name] = arr.reshape(shape).copy()
    return out, metadata


def save(path, tensors, metadata=None, dtypes=None):
    """Writes tensors (dict name -> numpy array) to path.

    dtypes: optional dict name -> safetensors dtype string to force (e.g. "BF16")."""
    dtypes = dtypes or {}
    header = {}
    chunks = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        want = dtypes.get(name)
        if want == "BF16":
            data = _f32_to_bf16_bits(arr.astype(np.float32)).tobytes()
            st = "BF16"
        else:
            if want is not None:
                arr = arr.astype(_DTYPES[want])
            dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder not in "|" else arr.dtype
            st = None
            for k, v in _DTYPES.items():
                if v == dt:
                    st = k
                    break
            if st is None:
                raise ValueError(f"tensor {name}: unsupported numpy dtype {arr.dtype}")
            data = np.ascontiguousarray(arr.astype(_DTYPES[st])).tobytes()
        header[name] = {"dtype": st, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for c in chunks:
            f.write(c)


# ---- torch helpers (torch imported lazily so the numpy part works without it) ----

def load_torch(path):
    import torch
    arrays, metadata = load(path)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}, metadata


def save_torch(path, tensors, metadata=None, dtypes=None):
    arrays = {k: v.detach().cpu().contiguous().numpy() for k, v in tensors.items()}
    save(path, arrays, metadata=metadata, dtypes=dtypes)
