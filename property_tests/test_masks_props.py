"""Fuzzed mask compositions: algebra laws on materialized masks, and soundness of
the block description (EMPTY tiles hold no allowed pair, FULL tiles only allowed
pairs) for every composition, alignment and block size."""

import jax
import numpy as np
from hypothesis import given, strategies as st

from fnattn import masks
from strategies import mask_trees

H = 2


@st.composite
def mask_pairs(draw, n=2):
    B, Tq, Tk = draw(st.integers(1, 2)), draw(st.integers(1, 17)), draw(st.integers(1, 17))
    return (B, Tq, Tk) + tuple(draw(mask_trees(B, Tq, Tk, H=H)) for _ in range(n))


def dense(m, B, Tq, Tk):
    return np.broadcast_to(np.asarray(jax.jit(lambda m: masks.materialize(m, B, H, Tq, Tk))(m)),
                           (B, H, Tq, Tk))


@given(mask_pairs(3))
def test_algebra_laws(args):
    B, Tq, Tk, a, b, c = args
    composed = [a, b, c, a & b, a | b, ~(a & b), ~(a | b), ~~a, a & (b | c), a | (a & b),
                a & ~a, a | ~a]
    # one compilation materializes every composition
    got = jax.jit(lambda ms: [masks.materialize(m, B, H, Tq, Tk) for m in ms])(composed)
    da, db, dc, d_and, d_or, d_nand, d_nor, d_nn, d_dist, d_abs, d_none, d_all = (
        np.broadcast_to(np.asarray(x), (B, H, Tq, Tk)) for x in got)
    eq = np.testing.assert_array_equal
    eq(d_and, da & db)
    eq(d_or, da | db)
    eq(d_nand, ~da | ~db)  # De Morgan
    eq(d_nor, ~da & ~db)
    eq(d_nn, da)  # double negation
    eq(d_dist, (da & db) | (da & dc))  # distributivity
    eq(d_abs, da)  # absorption
    assert not d_none.any() and d_all.all()


@given(mask_pairs(1), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 3, 4, 8]))
def test_block_classes_are_sound(args, bq, bk):
    B, Tq, Tk, a = args
    d = dense(a, B, Tq, Tk)
    c = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, H, Tq, Tk, bq, bk))(a))
    assert c.shape[2:] == (-(-Tq // bq), -(-Tk // bk)) and c.dtype == np.int8
    c = np.broadcast_to(c, (B, H) + c.shape[2:])
    for i in range(c.shape[2]):
        for j in range(c.shape[3]):
            tile = d[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            ragged = (i + 1) * bq > Tq or (j + 1) * bk > Tk
            assert not ((c[:, :, i, j] == masks.EMPTY) & tile.any((2, 3))).any()
            assert not ((c[:, :, i, j] == masks.FULL) & ~tile.all((2, 3))).any()
            assert not (ragged and (c[:, :, i, j] == masks.FULL).any())


@given(mask_pairs(1), st.sampled_from([2, 4]))
def test_block_classes_of_a_negation_mirror_the_mask(args, blk):
    # FULL and EMPTY swap under ~ on interior tiles (edge tiles are never FULL)
    B, Tq, Tk, a = args
    c, n = jax.jit(lambda a: [masks.block_classes(m, B, H, Tq, Tk, blk, blk)
                              for m in (a, ~a)])(a)
    c, n = np.broadcast_arrays(np.asarray(c), np.asarray(n))
    interior = np.zeros(c.shape[2:], bool)
    interior[: Tq // blk, : Tk // blk] = True
    np.testing.assert_array_equal((c == masks.FULL) & interior, (n == masks.EMPTY) & interior)
    np.testing.assert_array_equal((c == masks.EMPTY) & interior, (n == masks.FULL) & interior)
