"""The mask algebra: patterns, alignment, composition, pytrees, block classes."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks

B, H, TQ, TK = 2, 3, 7, 11


def dense(m, tq=TQ, tk=TK, b=B, h=H):
    return np.broadcast_to(np.asarray(jax.jit(
        lambda m: masks.materialize(m, b, h, tq, tk))(m)), (b, h, tq, tk))


def grid(tq=TQ, tk=TK):
    q = np.arange(tq)[:, None]
    k = np.arange(tk)[None, :]
    return q, k, q + (tk - tq)


def test_causal_is_bottom_right_aligned():
    q, k, pos = grid()
    np.testing.assert_array_equal(dense(masks.causal())[0, 0], k <= pos)
    # square: the usual lower triangle
    np.testing.assert_array_equal(dense(masks.causal(), 5, 5)[0, 0], np.tril(np.ones((5, 5), bool)))
    # one query sees every key (decode)
    assert dense(masks.causal(), 1, 9)[0, 0].all()


@pytest.mark.parametrize("left,right", [(2, 0), (0, 0), (3, 1), (None, 2), (2, None)])
def test_sliding_window(left, right):
    q, k, pos = grid()
    want = np.ones((TQ, TK), bool)
    if left is not None:
        want &= k >= pos - left
    if right is not None:
        want &= k <= pos + right
    np.testing.assert_array_equal(dense(masks.sliding_window(left, right))[1, 2], want)


def test_chunked():
    q, k, pos = grid()
    np.testing.assert_array_equal(dense(masks.chunked(3))[0, 0], pos // 3 == k // 3)


def test_segments_and_default_kv_ids():
    rs = np.random.default_rng(0)
    qi = rs.integers(0, 3, (B, TQ))
    ki = rs.integers(0, 3, (B, TK))
    d = dense(masks.segments(jnp.asarray(qi), jnp.asarray(ki)))
    np.testing.assert_array_equal(d[:, 0], qi[:, :, None] == ki[:, None, :])
    d2 = dense(masks.segments(jnp.asarray(ki)), TK, TK)
    np.testing.assert_array_equal(d2[:, 1], ki[:, :, None] == ki[:, None, :])


def test_lengths():
    ql, kl = np.array([3, 7]), np.array([11, 4])
    d = dense(masks.lengths(jnp.asarray(ql), jnp.asarray(kl)))
    q, k, _ = grid()
    for b in range(B):
        np.testing.assert_array_equal(d[b, 0], (q < ql[b]) & (k < kl[b]))
    d = dense(masks.lengths(kv_lengths=jnp.asarray(kl)))
    assert d[1, 0, :, 4:].sum() == 0 and d[1, 0, :, :4].all()


def test_prefix_lm():
    p = np.array([2, 9])
    d = dense(masks.prefix_lm(jnp.asarray(p)))
    q, k, pos = grid()
    for b in range(B):
        np.testing.assert_array_equal(d[b, 0], (k < p[b]) | (k <= pos))


def test_from_array_and_from_fn():
    rs = np.random.default_rng(1)
    arr = rs.random((B, 1, TQ, TK)) < 0.5
    np.testing.assert_array_equal(dense(masks.from_array(jnp.asarray(arr)))[:, 2], arr[:, 0])
    d = dense(masks.from_fn(lambda b, h, q, k: (b + h + q * k) % 2 == 0))
    b_, h_, q_, k_ = np.ix_(range(B), range(H), range(TQ), range(TK))
    np.testing.assert_array_equal(d, (b_ + h_ + q_ * k_) % 2 == 0)


def test_algebra():
    a, b = masks.causal(), masks.sliding_window(left=2)
    da, db = dense(a), dense(b)
    np.testing.assert_array_equal(dense(a & b), da & db)
    np.testing.assert_array_equal(dense(a | b), da | db)
    np.testing.assert_array_equal(dense(~a), ~da)
    np.testing.assert_array_equal(dense(~(a & b)), ~da | ~db)


def test_bool_explains_and_vs_ampersand():
    with pytest.raises(TypeError, match="use `&`"):
        masks.causal() and masks.causal()
    with pytest.raises(TypeError, match="both sides must be fnattn.masks"):
        masks.causal() & True


def test_masks_are_pytrees_through_jit_and_vmap():
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 2, (4, 1, TK)))
    m = masks.segments(ids) & masks.causal()
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 2
    d = jax.jit(jax.vmap(lambda m: masks.materialize(m, 1, 1, TK, TK)))(m)
    assert d.shape == (4, 1, 1, TK, TK)
    for i in range(4):
        np.testing.assert_array_equal(d[i, 0, 0], dense(masks.segments(ids[i]) & masks.causal(),
                                                        TK, TK, 1, 1)[0, 0])


RANDOM_MASKS = [
    lambda ids, kl, p, arr: masks.causal(),
    lambda ids, kl, p, arr: masks.sliding_window(left=5, right=3),
    lambda ids, kl, p, arr: masks.chunked(6) & masks.causal(),
    lambda ids, kl, p, arr: masks.segments(ids[0], ids[1]),
    lambda ids, kl, p, arr: masks.lengths(kl[0], kl[1]),
    lambda ids, kl, p, arr: masks.prefix_lm(p),
    lambda ids, kl, p, arr: masks.from_array(arr),
    lambda ids, kl, p, arr: ~masks.causal() | masks.segments(ids[0], ids[1]),
    lambda ids, kl, p, arr: masks.causal() & ~masks.sliding_window(left=4),
    lambda ids, kl, p, arr: masks.from_fn(lambda b, h, q, k: q > k),
]


@pytest.mark.parametrize("make", RANDOM_MASKS)
@pytest.mark.parametrize("tq,tk,bq,bk", [(29, 37, 4, 8), (37, 29, 8, 4), (32, 32, 8, 8)])
def test_block_classes_are_sound(make, tq, tk, bq, bk):
    rs = np.random.default_rng(tq * tk)
    ids = (jnp.asarray(np.sort(rs.integers(0, 4, (B, tq)), 1)),
           jnp.asarray(np.sort(rs.integers(0, 4, (B, tk)), 1)))
    kl = (jnp.asarray(rs.integers(0, tq + 1, (B,))), jnp.asarray(rs.integers(0, tk + 1, (B,))))
    p = jnp.asarray(rs.integers(0, tk, (B,)))
    arr = jnp.asarray(rs.random((B, 1, tq, tk)) < 0.1)
    m = make(ids, kl, p, arr)
    d = dense(m, tq, tk)
    c = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, H, tq, tk, bq, bk))(m))
    c = np.broadcast_to(c, (B, H) + c.shape[2:])
    for i in range(c.shape[2]):
        for j in range(c.shape[3]):
            tile = d[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            empty = ~tile.any((2, 3))
            full = tile.all((2, 3)) & ((i + 1) * bq <= tq) & ((j + 1) * bk <= tk)
            assert not (c[:, :, i, j] == masks.EMPTY)[~empty].any()
            assert not (c[:, :, i, j] == masks.FULL)[~full].any()


def test_block_classes_exact_for_causal_and_sorted_segments():
    c = np.asarray(masks.block_classes(masks.causal(), 1, 1, 64, 64, 16, 16))[0, 0]
    np.testing.assert_array_equal(c, np.where(np.eye(4, dtype=bool), 1,
                                              np.where(np.tri(4, dtype=bool), 2, 0)))
    ids = jnp.asarray(np.repeat(np.arange(4), 16)[None])
    c = np.asarray(masks.block_classes(masks.segments(ids), 1, 1, 64, 64, 16, 16))[0, 0]
    np.testing.assert_array_equal(c, np.eye(4) * 2)


def test_block_classes_for_128k_tokens_with_segments_runs_in_jit(record_property):
    # No timed assertion: the time is printed (pytest -s) and recorded in the
    # junit report; about a millisecond on a 2-core CPU.
    T = 128 * 1024
    ids = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 64, (1, T)), 1))
    f = jax.jit(lambda ids: masks.block_classes(masks.causal() & masks.segments(ids),
                                                1, 1, T, T, 512, 512))
    f(ids).block_until_ready()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        c = f(ids).block_until_ready()
        times.append(time.perf_counter() - t0)
    print(f"block_classes, T=128k, causal & segments, 512x512 tiles: {min(times) * 1e3:.2f} ms")
    record_property("block_classes_128k_seconds", min(times))
    assert c.shape == (1, 1, 256, 256)
    c = np.asarray(c)[0, 0]
    assert (c == masks.EMPTY).mean() > 0.5
    # spot-check against the dense mask on a 4k corner (the whole 128k one is 16 GB)
    n = 4096
    d = np.tril(np.ones((n, n), bool)) & (np.asarray(ids)[0, :n, None] == np.asarray(ids)[0, None, :n])
    tiles = d.reshape(8, 512, 8, 512)
    np.testing.assert_array_equal(c[:8, :8] == masks.FULL, tiles.all((1, 3)))
    np.testing.assert_array_equal(c[:8, :8] == masks.EMPTY, ~tiles.any((1, 3)))


def test_render():
    assert masks.render(masks.causal(), 2, 3) == "x x .\nx x x"


@pytest.mark.parametrize("bad,match", [
    (lambda: masks.sliding_window(-1), "left must be a non-negative int"),
    (lambda: masks.sliding_window(2, -3), "right must be a non-negative int"),
    (lambda: masks.sliding_window(None, None), "cannot both be None"),
    (lambda: masks.chunked(0), "size must be a positive int"),
    (lambda: masks.lengths(), "give q_lengths, kv_lengths or both"),
    (lambda: masks.from_array(jnp.ones((3, 3))), "must be boolean"),
    (lambda: masks.from_fn(3), "must be callable"),
])
def test_constructor_errors(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def test_alignment_when_there_are_more_queries_than_keys():
    # q_pos = q + (Tk - Tq) is negative for the first Tq - Tk rows: they see nothing
    tq, tk = 11, 7
    q, k, pos = grid(tq, tk)
    d = dense(masks.causal(), tq, tk)[0, 0]
    np.testing.assert_array_equal(d, k <= pos)
    assert not d[:4].any() and d[4, 0] and not d[4, 1:].any() and d[-1].all()
    np.testing.assert_array_equal(dense(masks.sliding_window(left=2), tq, tk)[0, 0],
                                  (k <= pos) & (k >= pos - 2))
    np.testing.assert_array_equal(dense(masks.chunked(3), tq, tk)[0, 0], pos // 3 == k // 3)
    p = np.array([2, 5])
    d = dense(masks.prefix_lm(jnp.asarray(p)), tq, tk)
    for b in range(B):
        np.testing.assert_array_equal(d[b, 0], (k < p[b]) | (k <= pos))


def test_array_masks_use_raw_rows_not_aligned_positions():
    # segments, lengths and from_array index their arrays by the raw query row
    ql = np.array([2, 5])
    d = dense(masks.lengths(q_lengths=jnp.asarray(ql)))
    q, _, _ = grid()
    for b in range(B):
        np.testing.assert_array_equal(d[b, 0], np.broadcast_to(q < ql[b], (TQ, TK)))
    fn = dense(masks.from_fn(lambda b, h, q, k: q == 0))
    assert fn[0, 0, 0].all() and not fn[0, 0, 1:].any()


def test_full_and_none_are_everything():
    assert dense(masks.full()).all()
    assert np.asarray(masks.materialize(None, B, H, TQ, TK)).all()
    np.testing.assert_array_equal(dense(masks.full() & masks.causal()), dense(masks.causal()))


def test_from_array_with_a_head_axis():
    rs = np.random.default_rng(3)
    arr = rs.random((1, H, TQ, TK)) < 0.5
    d = dense(masks.from_array(jnp.asarray(arr)))
    for b in range(B):
        np.testing.assert_array_equal(d[b], arr[0])
    assert masks.render(masks.from_array(jnp.asarray(arr)), TQ, TK, head=2) == "\n".join(
        " ".join("x" if x else "." for x in row) for row in arr[0, 2])


def test_masks_built_inside_jit_from_traced_arrays():
    @jax.jit
    def f(ids, lengths):
        return masks.materialize(masks.segments(ids) & masks.lengths(kv_lengths=lengths),
                                 B, H, TK, TK)

    rs = np.random.default_rng(4)
    ids = rs.integers(0, 3, (B, TK))
    lengths = np.array([4, 9])
    d = np.broadcast_to(np.asarray(f(jnp.asarray(ids), jnp.asarray(lengths))), (B, H, TK, TK))
    k = np.arange(TK)
    for b in range(B):
        np.testing.assert_array_equal(
            d[b, 0], (ids[b, :, None] == ids[b, None, :]) & (k[None, :] < lengths[b]))


def test_repr():
    m = masks.causal() & ~masks.sliding_window(left=4) | masks.chunked(3)
    assert repr(m) == "((causal() & ~sliding_window(left=4, right=0)) | chunked(3))"
    assert repr(masks.segments(jnp.zeros((1, 3), jnp.int32))) == "segments(...)"


def _consecutive_ids(rs, b, t):
    # document ids 0, 1, 2, ... without gaps, as packing produces
    return np.cumsum(rs.random((b, t)) < 0.15, axis=1)


EXACT = {
    "causal": lambda rs, tq, tk: masks.causal(),
    "window": lambda rs, tq, tk: masks.sliding_window(left=5, right=2),
    "causal_window": lambda rs, tq, tk: masks.causal() & masks.sliding_window(left=9),
    "chunked": lambda rs, tq, tk: masks.chunked(6),
    "segments": lambda rs, tq, tk: masks.segments(jnp.asarray(_consecutive_ids(rs, B, tk))),
    "lengths": lambda rs, tq, tk: masks.lengths(jnp.asarray(rs.integers(0, tq + 1, (B,))),
                                                jnp.asarray(rs.integers(0, tk + 1, (B,)))),
    "array": lambda rs, tq, tk: masks.from_array(jnp.asarray(rs.random((B, H, tq, tk)) < 0.97)),
    "full": lambda rs, tq, tk: masks.full(),
}


@pytest.mark.parametrize("name", list(EXACT))
@pytest.mark.parametrize("tq,tk,bq,bk", [(37, 37, 4, 8), (29, 41, 8, 4)])
def test_block_classes_are_exact_for_single_structured_masks(name, tq, tk, bq, bk):
    if name == "segments":
        tq = tk  # self-attention over one packed sequence
    rs = np.random.default_rng(tq + tk)
    m = EXACT[name](rs, tq, tk)
    d = dense(m, tq, tk)
    c = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, H, tq, tk, bq, bk))(m))
    c = np.broadcast_to(c, (B, H) + c.shape[2:])
    nq, nk = -(-tq // bq), -(-tk // bk)
    pad = np.zeros((B, H, nq * bq, nk * bk), bool)
    valid = np.zeros_like(pad)
    pad[:, :, :tq, :tk] = d
    valid[:, :, :tq, :tk] = True
    tiles = pad.reshape(B, H, nq, bq, nk, bk)
    any_ = tiles.any((3, 5))
    all_ = (tiles | ~valid.reshape(tiles.shape)).all((3, 5))
    interior = np.zeros((nq, nk), bool)
    interior[: tq // bq, : tk // bk] = True
    # EMPTY exactly where the tile has no allowed pair; FULL exactly where an
    # interior tile is all allowed (edge tiles are never FULL, by design)
    np.testing.assert_array_equal(c == masks.EMPTY, ~any_)
    np.testing.assert_array_equal(c == masks.FULL, all_ & any_ & interior)


def test_python_lists_and_numpy_arrays_work_under_jit():
    # Lists used to reach jit as pytrees of Python ints and die inside JAX.
    q = jax.random.normal(jax.random.key(0), (2, 4, 2, 8))
    ids = [[0, 0, 1, 1], [0, 1, 1, 1]]
    for as_list, as_array in [
        (masks.lengths([3, 4], [4, 2]), masks.lengths(jnp.array([3, 4]), jnp.array([4, 2]))),
        (masks.segments(ids), masks.segments(jnp.array(ids))),
        (masks.prefix_lm(np.array([2, 3])), masks.prefix_lm(jnp.array([2, 3]))),
        (masks.from_array([[True, False, True, True]] * 4),
         masks.from_array(jnp.array([[True, False, True, True]] * 4))),
    ]:
        a = jax.jit(fnattn.attention)(AttentionSpec(mask=as_list), q, q, q)
        b = jax.jit(fnattn.attention)(AttentionSpec(mask=as_array), q, q, q)
        np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
