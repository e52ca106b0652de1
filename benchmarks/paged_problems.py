"""Paged decode problems and functions to time (benchmarks/decode.py, benchmarks/gpu.py).

``decode_problem`` builds a batch of sequences whose pages are a random
permutation of the pool; ``decode_fn`` returns a jitted function of the
problem's arrays; ``decode_bytes`` is the HBM traffic of one call (every
visible key and value once, plus q and the output), from which bandwidth
follows. ``gather_decode`` is the plain ``jnp`` gather-then-softmax baseline.

>>> prob = decode_problem(batch=2, context=40, num_q_heads=4, num_kv_heads=2,
...                       head_dim=16, page_size=8)
>>> out = decode_fn(impl="xla")(*prob.args)
>>> out.shape, decode_bytes(prob) > 0
((2, 1, 4, 16), True)
"""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fnattn import AttentionSpec, PagedBlockSizes, masks, paged_attention

__all__ = ["DecodeProblem", "decode_problem", "decode_fn", "decode_bytes", "gather_decode"]


@dataclasses.dataclass
class DecodeProblem:
    args: tuple     # (q, k_pages, v_pages, page_table, kv_lengths)
    batch: int
    context: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: Any


def decode_problem(batch: int, context: int, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, dtype=jnp.bfloat16, *, q_len: int = 1,
                   seed: int = 0) -> DecodeProblem:
    """Every sequence has ``context`` keys; the pool has exactly the pages needed."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, q_len, num_q_heads, head_dim), dtype)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    return DecodeProblem((q, k_pages, v_pages, jnp.asarray(table), lengths), batch, context,
                         q_len, num_q_heads, num_kv_heads, head_dim, page_size, dtype)


def decode_fn(impl: str = "auto", block_sizes: Optional[PagedBlockSizes] = None,
              mask=None):
    """A jitted ``f(q, k_pages, v_pages, page_table, kv_lengths) -> out`` (no lse)."""
    spec = AttentionSpec(mask=masks.causal() if mask is None else mask, impl=impl,
                         block_sizes=block_sizes, return_lse=False)

    @jax.jit
    def f(q, k_pages, v_pages, page_table, kv_lengths):
        return paged_attention(spec, q, k_pages, v_pages, page_table=page_table,
                               kv_lengths=kv_lengths).out

    return f


def decode_bytes(p: DecodeProblem) -> int:
    item = jnp.dtype(p.dtype).itemsize
    kv = 2 * p.batch * p.context * p.num_kv_heads * p.head_dim * item
    qo = 2 * p.batch * p.q_len * p.num_q_heads * p.head_dim * item
    return kv + qo


@jax.jit
def gather_decode(q, k_pages, v_pages, page_table, kv_lengths):
    """The plain baseline: gather every page of every sequence, then a masked softmax."""
    B, Tq, Hq, D = q.shape
    Hkv, _, ps, _ = k_pages.shape
    L = page_table.shape[1] * ps
    k = k_pages[:, page_table].reshape(Hkv, B, L, D)
    v = v_pages[:, page_table].reshape(Hkv, B, L, -1)
    qg = q.reshape(B, Tq, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bthgd,hbkd->bhgtk", qg, k, preferred_element_type=jnp.float32)
    s = s * D ** -0.5
    pos = kv_lengths[:, None, None, None, None] - Tq + jnp.arange(Tq)[:, None]
    ok = jnp.arange(L) <= pos
    p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgtk,hbkd->bthgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, Tq, Hq, -1).astype(q.dtype)
