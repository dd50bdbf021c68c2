"""Read a GGUF file (llama.cpp's format) with numpy alone.

A GGUF file is a header of typed key/value metadata, a table of tensor
descriptions, then the tensor bytes, aligned. We memory-map the file, parse the
two tables with `struct`, and dequantize the three tensor types SmolLM2 ships in
(F16 and Q4_0 are read too):

    F32    plain float32
    Q8_0   blocks of 32 values: one float16 scale d, 32 int8 q;  x = d * q
    Q4_1   blocks of 32 values: float16 scale d, float16 min m, 16 bytes of
           4-bit q (low nibbles are values 0..15, high nibbles 16..31); x = d * q + m

Format reference: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

import struct

import numpy as np

FETCH_HINT = "python -m minagent.weights fetch"
MAX_NESTING = 8       # arrays of arrays of ...: deeper is a corrupt file, not a model
MAX_DIMS = 4          # ggml tensors have at most 4 dimensions

# metadata value types -> struct format (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml tensor types we can read: name, values per block, bytes per block
_TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18),
                 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}


class GGUFError(ValueError):
    """The file is not a GGUF file we can read (missing, truncated, corrupt)."""


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def truncated(self, where):
        return GGUFError(f"{self.path}: file ends in the middle of {where} (truncated?); "
                         f"fetch it again with `{FETCH_HINT}`")

    def take(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.truncated("the header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self):
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise self.truncated("a string")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype, key, depth=0):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            elem_type, count = self.take("<I"), self.take("<Q")
            # arrays of arrays: llama.cpp writes none deeper
            if elem_type == 9 and depth >= MAX_NESTING:
                raise GGUFError(f"{self.path}: metadata {key}: arrays nested more than "
                                f"{MAX_NESTING} deep")
            if count > len(self.buf) - self.pos:            # every element takes at least one byte
                raise self.truncated(f"the array {key}")
            return [self.value(elem_type, key, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.path}: metadata {key}: unknown value type {vtype}")


def read(path):
    """Parse `path` -> (metadata dict, {tensor name: (ggml type name, shape, raw uint8 array)}).

    Shapes are given the numpy way (slowest axis first): GGUF lists dimensions
    fastest first, so a [576, 49152] GGUF tensor is a (49152, 576) array here.
    """
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; fetch it with `{FETCH_HINT}`") from None
    except ValueError:   # numpy cannot map an empty file
        raise GGUFError(f"{path}: empty file; fetch it again with `{FETCH_HINT}`") from None
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF"[:len(buf)]:  # a file cut in the magic is truncated, not foreign
        raise GGUFError(f"{path}: not a GGUF file (bad magic); fetch it again with `{FETCH_HINT}`")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in meta:
            raise GGUFError(f"{path}: metadata key {key} is given twice")
        meta[key] = cur.value(cur.take("<I"), key)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} "
                            f"expected)")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1:
        raise GGUFError(f"{path}: general.alignment is {align!r}; a positive integer expected")
    data_start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, dims, ttype, offset in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name} is listed twice")
        if ttype not in _TENSOR_TYPES:
            raise GGUFError(f"{path}: tensor {name} has ggml type {ttype}, which minagent cannot "
                            f"dequantize")
        tname, per_block, block_bytes = _TENSOR_TYPES[ttype]
        shape = tuple(reversed(dims))
        n_values = 1
        for d in dims:                      # Python ints: a product past 2**64 stays exact
            n_values *= d
        if n_values % per_block or n_values * block_bytes // per_block > len(buf):
            raise GGUFError(f"{path}: tensor {name} has shape {shape}, which a {tname} tensor in "
                            f"this file cannot hold (corrupt, or truncated?)")
        n_bytes = n_values // per_block * block_bytes
        start = data_start + offset
        if start + n_bytes > len(buf):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?); "
                            f"fetch it again with `{FETCH_HINT}`")
        tensors[name] = (tname, shape, buf[start:start + n_bytes])
    return meta, tensors


def dequantize(tname, shape, raw):
    """Raw GGUF bytes of one tensor -> float32 array of `shape`."""
    if tname == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    if tname == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    blocks = raw.reshape(-1, _TENSOR_TYPES[{"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}[tname]][2])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)        # [n_blocks, 1]
    if tname == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)        # [n_blocks, 32]
        x = d * q
    else:
        nibbles = blocks[:, 4:] if tname == "Q4_1" else blocks[:, 2:]    # [n_blocks, 16]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
        if tname == "Q4_1":
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            x = d * q + m
        else:  # Q4_0: values are offset by 8
            x = d * (q - 8)
    return x.reshape(shape)
