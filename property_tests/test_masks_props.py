"""Fuzzed mask compositions: algebra laws and soundness of block classes."""

import jax
import numpy as np
from hypothesis import given, strategies as st

from fnattn import masks
from strategies import mask_trees


@st.composite
def two_masks(draw):
    B, Tq, Tk = draw(st.integers(1, 2)), draw(st.integers(1, 17)), draw(st.integers(1, 17))
    return B, Tq, Tk, draw(mask_trees(B, Tq, Tk)), draw(mask_trees(B, Tq, Tk))


def dense(m, B, Tq, Tk):
    return np.broadcast_to(np.asarray(jax.jit(lambda m: masks.materialize(m, B, 2, Tq, Tk))(m)),
                           (B, 2, Tq, Tk))


@given(two_masks())
def test_algebra_laws(args):
    B, Tq, Tk, a, b = args
    da, db = dense(a, B, Tq, Tk), dense(b, B, Tq, Tk)
    np.testing.assert_array_equal(dense(~(a & b), B, Tq, Tk), ~da | ~db)
    np.testing.assert_array_equal(dense(~(a | b), B, Tq, Tk), ~da & ~db)
    np.testing.assert_array_equal(dense(~~a, B, Tq, Tk), da)


@given(two_masks(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 3, 4, 8]))
def test_block_classes_are_sound(args, bq, bk):
    B, Tq, Tk, a, _ = args
    d = dense(a, B, Tq, Tk)
    c = np.asarray(jax.jit(lambda m: masks.block_classes(m, B, 2, Tq, Tk, bq, bk))(a))
    c = np.broadcast_to(c, (B, 2) + c.shape[2:])
    for i in range(c.shape[2]):
        for j in range(c.shape[3]):
            tile = d[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            assert not ((c[:, :, i, j] == masks.EMPTY) & tile.any((2, 3))).any()
            assert not ((c[:, :, i, j] == masks.FULL) & ~tile.all((2, 3))).any()
