"""The delta codec on its own: exact round trips for every width and mode, and checksummed frames."""

from __future__ import annotations

import numpy as np
import pytest

from policy.registry import codec


def _pair(rng, dtype, n, frac, spread=3):
    info = np.iinfo(dtype)
    base = rng.integers(0, info.max, n, dtype=dtype, endpoint=True)
    new = base.copy()
    mask = rng.random(n) < frac
    steps = rng.integers(-spread, spread + 1, int(mask.sum())).astype(np.int64)
    new[mask] = (base[mask].astype(np.int64) + steps).astype(dtype)  # wraps at both ends of the range
    return base, new


def _roundtrip(frame: bytes, base: np.ndarray) -> np.ndarray:
    (ref,) = codec.parse_frames(frame)
    out = base.copy()
    codec.decode_frame(ref, out)
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("frac", [0.0, 0.003, 0.2, 0.7, 1.0])
def test_delta_roundtrip_is_exact(dtype, frac):
    rng = np.random.default_rng(int(frac * 1000) + np.dtype(dtype).itemsize)
    base, new = _pair(rng, dtype, 20_000, frac)
    top = np.full(2, np.iinfo(dtype).max, dtype=dtype)
    new[:2] = [(base[:1] + top[:1])[0], (base[1:2] ^ top[1:])[0]]  # extreme moves (array ops wrap)
    frame, stats = codec.encode_chunk(7, 0, new, base, level=1)
    assert np.array_equal(_roundtrip(frame, base), new)
    assert stats.changed == int(np.count_nonzero(new != base))
    if frac <= 0.2:
        assert stats.mode == codec.SPARSE


def test_modes_same_sparse_dense_raw():
    rng = np.random.default_rng(0)
    base, _ = _pair(rng, np.uint16, 5000, 0)
    frame, stats = codec.encode_chunk(0, 0, base.copy(), base)
    assert stats.mode == codec.SAME and len(frame) < 64
    # every element moving by one ulp: no gaps to store, but dense must not lose to sparse
    new = base + np.uint16(1)
    frame, stats = codec.encode_chunk(0, 0, new, base, dense_probe=0.5)
    assert stats.mode in (codec.SPARSE, codec.DENSE)
    assert np.array_equal(_roundtrip(frame, base), new)
    frame_dense, st = codec.encode_chunk(0, 0, new, base, dense_probe=0.0)
    assert len(frame_dense) <= len(frame) and np.array_equal(_roundtrip(frame_dense, base), new)
    raw, st = codec.encode_raw(3, 0, new, 1)
    assert st.mode == codec.RAW
    assert np.array_equal(_roundtrip(raw, np.zeros_like(new)), new)


def test_sparse_is_close_to_entropy_bound_for_ulp_moves():
    # bf16-like update: 2% of elements move by +-1 unit in the last place
    rng = np.random.default_rng(1)
    n = 1 << 20
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = base.copy()
    idx = rng.choice(n, n // 50, replace=False)
    new[idx] += rng.choice(np.array([1, 65535], dtype=np.uint16), idx.size)
    frame, _ = codec.encode_chunk(0, 0, new, base)
    p = idx.size / n
    bound_bits = n * (-(p * np.log2(p / 2)) - (1 - p) * np.log2(1 - p))  # zero, +1, -1 symbols
    assert len(frame) * 8 < 1.15 * bound_bits
    assert base.nbytes / len(frame) > 60


def test_frames_concatenate_and_keep_their_place():
    rng = np.random.default_rng(2)
    base, new = _pair(rng, np.uint32, 3000, 0.1)
    f1, _ = codec.encode_chunk(4, 0, new[:1000], base[:1000])
    f2, _ = codec.encode_chunk(4, 1000, new[1000:], base[1000:])
    refs = codec.parse_frames(f1 + f2)
    assert [(r.tensor_index, r.start, r.count) for r in refs] == [(4, 0, 1000), (4, 1000, 2000)]
    out = base.copy()
    for r in refs:
        codec.decode_frame(r, out[r.start:r.start + r.count])
    assert np.array_equal(out, new)


def test_every_corrupted_byte_of_a_frame_is_detected():
    rng = np.random.default_rng(3)
    base, new = _pair(rng, np.uint16, 600, 0.05)
    frame, _ = codec.encode_chunk(1, 0, new, base)
    for pos in range(len(frame)):
        bad = bytearray(frame)
        bad[pos] ^= 0x01
        with pytest.raises(codec.FrameError):
            refs = codec.parse_frames(bytes(bad))
            for r in refs:
                codec.decode_frame(r, base.copy())
    with pytest.raises(codec.FrameError):
        codec.parse_frames(frame[:-1])
    with pytest.raises(codec.FrameError):
        codec.parse_frames(frame + b"\x00")


def test_decode_refuses_a_target_of_the_wrong_size():
    base = np.zeros(10, np.uint16)
    frame, _ = codec.encode_chunk(0, 0, base + np.uint16(1), base)
    (ref,) = codec.parse_frames(frame)
    with pytest.raises(codec.FrameError):
        codec.decode_frame(ref, np.zeros(9, np.uint16))
