"""The numpy GGUF reader: a small file written here byte by byte, then the real one.

    python -m pytest tests/engine/test_gguf.py -q

The hand-written file has known values for every tensor type gguf.py reads
(F32, F16, Q8_0, Q4_0, Q4_1), a non-default alignment and a string array; cut
at every byte it must fail with a GGUFError that says so. The SmolLM2 file
(skipped when absent) must give exactly what the `gguf` package gives.
"""

import struct

import numpy as np
import pytest

from minagent import gguf

# ---------------------------------------------------------------- writing a GGUF file by hand

STRING, ARRAY, UINT32, INT32, FLOAT32, BOOL = 8, 9, 4, 5, 6, 7
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8


def pack_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_value(vtype, value):
    if vtype == STRING:
        return pack_string(value)
    if vtype == ARRAY:
        elem_type, items = value
        return struct.pack("<IQ", elem_type, len(items)) + b"".join(pack_value(elem_type, x) for x in items)
    return struct.pack({UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?"}[vtype], value)


def gguf_bytes(metadata, tensors, alignment=32, version=3, magic=b"GGUF"):
    """metadata: [(key, type, value)]; tensors: [(name, dims fastest first, ggml type, raw bytes)].

    Layout: magic, version, counts, key/values, tensor infos, padding to
    `alignment`, then each tensor's bytes at an aligned offset.
    """
    out = magic + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, vtype, value in metadata:
        out += pack_string(key) + struct.pack("<I", vtype) + pack_value(vtype, value)
    data, offsets = b"", []
    for _, _, _, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        offsets.append(len(data))
        data += raw
    for (name, dims, ttype, _), offset in zip(tensors, offsets):
        out += pack_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ttype, offset)
    return out + b"\0" * (-len(out) % alignment) + data


def f16(x):
    return np.float16(x).tobytes()


# Known values, in blocks of 32. Scales and mins are exact in float16, so every expected value is exact.
Q8_BLOCKS = [(0.5, list(range(-16, 16))), (-2.0, [127, -128] + [3] * 30)]                  # (d, 32 int8 q)
Q4_1_BLOCKS = [(0.25, -1.0, list(range(16)) + list(range(15, -1, -1))), (2.0, 0.5, [7] * 32)]  # (d, m, 32 q)
Q4_0_BLOCKS = [(1.5, [0, 8, 15, 1] * 8)]                                                        # (d, 32 q)


def nibbles(q):
    """32 values 0..15 -> 16 bytes: byte j holds q[j] in its low nibble and q[j + 16] in its high one."""
    return bytes(q[j] | (q[j + 16] << 4) for j in range(16))


def known_tensors():
    """[(name, dims, ggml type, raw bytes, expected float32 array in numpy's shape)]."""
    q8 = b"".join(f16(d) + np.array(q, np.int8).tobytes() for d, q in Q8_BLOCKS)
    q4_1 = b"".join(f16(d) + f16(m) + nibbles(q) for d, m, q in Q4_1_BLOCKS)
    q4_0 = b"".join(f16(d) + nibbles(q) for d, q in Q4_0_BLOCKS)
    return [
        ("norm.weight", [4], F32, np.array([1, -2, 0.5, 3.25], np.float32).tobytes(),
         np.array([1, -2, 0.5, 3.25], np.float32)),
        # GGUF lists dims fastest first: [3, 2] is 2 rows of 3
        ("proj.weight", [3, 2], F32, np.arange(6, dtype=np.float32).tobytes(),
         np.array([[0, 1, 2], [3, 4, 5]], np.float32)),
        ("half.weight", [2], F16, np.array([0.5, -8], np.float16).tobytes(), np.array([0.5, -8], np.float32)),
        ("embd.weight", [32, 2], Q8_0, q8, np.array([[d * x for x in q] for d, q in Q8_BLOCKS], np.float32)),
        ("ffn.weight", [32, 2], Q4_1, q4_1,
         np.array([[d * x + m for x in q] for d, m, q in Q4_1_BLOCKS], np.float32)),
        ("old.weight", [32], Q4_0, q4_0, np.array([d * (x - 8) for d, q in Q4_0_BLOCKS for x in q], np.float32)),
    ]


METADATA = [
    ("general.architecture", STRING, "llama"),
    ("general.alignment", UINT32, 64),
    ("llama.block_count", UINT32, 2),
    ("llama.rope.freq_base", FLOAT32, 100000.0),
    ("tokenizer.ggml.add_bos_token", BOOL, False),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<|im_start|>", "a", "ü", "日本", ""])),
    ("tokenizer.ggml.token_type", ARRAY, (INT32, [3, 1, 1, 1, -1])),
]


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes(METADATA, [t[:4] for t in known_tensors()], alignment=64))
    return path


# ---------------------------------------------------------------- the hand-written file

def test_reads_metadata(tiny_gguf):
    meta, _ = gguf.read(tiny_gguf)
    assert meta == {"general.architecture": "llama", "general.alignment": 64, "llama.block_count": 2,
                    "llama.rope.freq_base": 100000.0, "tokenizer.ggml.add_bos_token": False,
                    "tokenizer.ggml.tokens": ["<|im_start|>", "a", "ü", "日本", ""],
                    "tokenizer.ggml.token_type": [3, 1, 1, 1, -1]}


def test_dequantizes_to_known_values(tiny_gguf):
    _, tensors = gguf.read(tiny_gguf)
    assert list(tensors) == [name for name, *_ in known_tensors()]
    type_names = {F32: "F32", F16: "F16", Q8_0: "Q8_0", Q4_1: "Q4_1", Q4_0: "Q4_0"}
    for name, _, ttype, _, expected in known_tensors():
        tname, shape, raw = tensors[name]
        assert (tname, shape) == (type_names[ttype], expected.shape), name
        values = gguf.dequantize(tname, shape, raw)
        assert values.dtype == np.float32
        np.testing.assert_array_equal(values, expected, err_msg=name)


def test_every_truncation_is_a_clear_error(tmp_path, tiny_gguf):
    """Cut the file after every byte: header, strings, tensor table, padding, data."""
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(gguf.GGUFError) as err:
            gguf.read(cut)
        message = str(err.value)
        assert ("truncated" in message or "empty" in message) and gguf.FETCH_HINT in message, (n, message)


def test_bad_magic(tmp_path):
    path = tmp_path / "page.gguf"
    path.write_bytes(b"<!DOCTYPE html><html>404 Not Found</html>")   # what a failed download often is
    with pytest.raises(gguf.GGUFError, match="not a GGUF file"):
        gguf.read(path)
    path.write_bytes(gguf_bytes(METADATA, [], magic=b"GGML"))
    with pytest.raises(gguf.GGUFError, match="bad magic"):
        gguf.read(path)


def test_unsupported_version_and_tensor_type(tmp_path):
    path = tmp_path / "odd.gguf"
    path.write_bytes(gguf_bytes(METADATA, [], version=1))
    with pytest.raises(gguf.GGUFError, match="version 1"):
        gguf.read(path)
    q4_k = 12   # a k-quant: a valid GGUF type that minagent does not dequantize
    path.write_bytes(gguf_bytes(METADATA, [("blk.0.attn_q.weight", [256], q4_k, b"\0" * 144)]))
    with pytest.raises(gguf.GGUFError, match="blk.0.attn_q.weight"):
        gguf.read(path)


def test_missing_file_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m minagent.weights fetch"):
        gguf.read(tmp_path / "nowhere.gguf")


# ---------------------------------------------------------------- the real file

@pytest.mark.slow    # a comparison with the reference package; dequantizes every tensor twice, ours and the gguf package's: 7-8 s
def test_smollm2_matches_the_gguf_package(smollm2_gguf):
    """Every metadata value and every dequantized tensor equal the reference reader's, exactly."""
    ref = pytest.importorskip("gguf")   # the PyPI package (llama.cpp's), not minagent.gguf
    reader = ref.GGUFReader(str(smollm2_gguf))
    meta, tensors = gguf.read(smollm2_gguf)

    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert fields == meta

    assert sorted(t.name for t in reader.tensors) == sorted(tensors)
    seen = set()
    for t in reader.tensors:
        tname, shape, raw = tensors[t.name]
        assert tname == t.tensor_type.name, t.name
        seen.add(tname)
        expected = ref.quants.dequantize(t.data, t.tensor_type)
        ours = gguf.dequantize(tname, shape, raw)
        assert ours.shape == expected.shape, t.name
        np.testing.assert_array_equal(ours, expected, err_msg=t.name)
    assert seen == {"F32", "Q8_0", "Q4_1"}


# ---------------------------------------------------------------- inconsistent files

def write(tmp_path, data, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("alignment", [0, -1])
def test_an_alignment_below_one_is_named(tmp_path, alignment):
    data = gguf_bytes([("general.alignment", INT32, alignment)], [("w", [4], F32, b"\0" * 16)])
    with pytest.raises(gguf.GGUFError, match="general.alignment is"):
        gguf.read(write(tmp_path, data))


def test_arrays_nested_thousands_deep_are_refused(tmp_path):
    # one key whose value is [[[...[]...]]], 5,000 deep: a RecursionError without a limit
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + pack_string("deep") + struct.pack("<I", ARRAY)
    body = b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(5000)) + struct.pack("<IQ", UINT32, 0)
    with pytest.raises(gguf.GGUFError, match="metadata deep: arrays nested more than 8 deep"):
        gguf.read(write(tmp_path, head + body))


def test_dimensions_whose_product_overflows_are_refused(tmp_path):
    data = gguf_bytes([], [("w", [2**40, 2**40], F32, b"\0" * 16)])       # 2**80 values, in 16 bytes
    with pytest.raises(gguf.GGUFError, match="tensor w has shape"):
        gguf.read(write(tmp_path, data))


def test_a_tensor_listed_twice_is_refused(tmp_path):
    data = gguf_bytes([], [("w", [4], F32, b"\0" * 16), ("w", [4], F32, b"\1" * 16)])
    with pytest.raises(gguf.GGUFError, match="tensor w is listed twice"):
        gguf.read(write(tmp_path, data))


def test_a_metadata_key_given_twice_is_refused(tmp_path):
    data = gguf_bytes([("a", UINT32, 1), ("a", UINT32, 2)], [])
    with pytest.raises(gguf.GGUFError, match="metadata key a is given twice"):
        gguf.read(write(tmp_path, data))
