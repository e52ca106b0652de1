"""The Pallas Mosaic GPU lowering of the flash-attention forward (Hopper, sm90a).

One kernel, warp-specialised: every program (CTA) owns ``2 * block_q`` query
rows of one (batch, query head) and runs three warpgroups.

* Warpgroups 0 and 1 (*consumers*) each hold ``block_q`` of those rows. Per
  kv-tile they compute ``S = Q K^T`` with ``plgpu.wgmma`` into a float32
  accumulator, run the online softmax in base 2 (``log2(e)`` folded into the
  scale) and add ``P V`` into a float32 output accumulator, again with
  ``wgmma``. A shared barrier staggers the two so that one's softmax overlaps
  the other's matrix multiplies.
* Warpgroup 2 (*producer*) streams the K and V tiles with TMA
  (``plgpu.copy_gmem_to_smem``) into a ring of ``max_concurrent_steps`` shared
  memory slots; per slot a *loaded* barrier (TMA done) and a *consumed*
  barrier (both consumers done with it) hand it back and forth.

Which kv-tiles a program visits comes from the mask's static block schedule
(:func:`fnattn.masks.block_classes_static` at the granularity of the whole
``2 * block_q`` tile, then :func:`fnattn.flash.blocks.schedule_static`): one
int32 row per (batch|1, head|1, q-tile), ``[n_full, n_visited, kv-tiles...]``,
FULL tiles first. Producer and consumers read the same row, so they iterate the
same list. FULL tiles run without mask code; the others evaluate the mask's
predicate elementwise on the tile's positions (and the bound of ragged
sequences: keys past ``Tk`` are not visible). EMPTY tiles are never loaded.

Keys a row may not see contribute nothing to it whatever their bits: hidden
logits are set to -inf on PARTIAL tiles, and for masked specs the wrapper makes
non-finite keys inert first (:func:`_hidden_keys_inert`: one elementwise pass
over K and V).

The kernel writes the output and the base-2 row state ``(m, l)``; the wrapper
turns the latter into ``lse`` and ``lse_lo`` (:func:`fnattn._online.lse_parts`),
so a row that sees no key gets ``out = 0`` and ``lse = -inf``. The residuals
are those of the Triton lowering, whose backward kernels :data:`LOWERING`
reuses.

Supported: float16 / bfloat16, ``D == Dv``, ``D % 64 == 0``, ``D <= 256``, any
scale, soft-cap, GQA, no mask or an array-free mask (causal, sliding windows,
chunks and their ``&``, ``|``, ``~``). :func:`supports` lists what else a spec
asks for; :func:`forward` refuses it with ``NotImplementedError``.

>>> import jax.numpy as jnp
>>> from fnattn import masks
>>> from fnattn._checks import Dims
>>> from fnattn._dispatch import Config
>>> cfg = Config(Dims(1, 256, 256, 4, 2, 128, 128), 128 ** -0.5, None, 0.0, None)
>>> supports(cfg, jnp.bfloat16, masks.causal(), None, None)
[]
>>> supports(cfg, jnp.float32, None, jnp.zeros((256, 256)), None)  # doctest: +ELLIPSIS
['a bias ...', 'float32 inputs ...']
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fnattn import _checks, masks
from fnattn import _online as online
from fnattn._dispatch import Lowering
from fnattn.flash import blocks, triton

__all__ = ["MosaicGpuBlockSizes", "LOWERING", "available", "forward", "route", "supports",
           "interpret_params"]

LOG2E, LN2 = online.LOG2E, online.LN2
F32 = jnp.float32
# The Triton kernels take what this one refuses.
_ELSEWHERE = "the Pallas Triton kernels (fnattn/flash/triton.py, impl='pallas') support it"
# Consumers hold the accumulators (more registers); the producer only issues copies.
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40
# Hopper's shared memory per block, less what the runtime keeps.
SMEM_BYTES = 227 * 1024


def _plgpu():
    # Imported on use: Mosaic GPU needs absl, which plain CPU installs may lack.
    import jax.experimental.pallas.mosaic_gpu as plgpu
    return plgpu


# ----------------------------------------------------------------------------------
# Block sizes
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MosaicGpuBlockSizes:
    """Tiles of the Mosaic GPU forward.

    Attributes:
      block_q: query rows of each consumer warpgroup (a program holds twice
        this); 64 or 128 (``wgmma`` works on 64-row slabs).
      block_k: kv rows per step; 64 or 128.
      max_concurrent_steps: depth of the K/V ring in shared memory, 2 to 4.

    >>> MosaicGpuBlockSizes.default(128).smem_bytes(128)
    164864
    >>> MosaicGpuBlockSizes(block_q=96)
    Traceback (most recent call last):
    ...
    ValueError: MosaicGpuBlockSizes: block_q must be 64 or 128; got 96
    """

    block_q: int = 64
    block_k: int = 128
    max_concurrent_steps: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            if getattr(self, name) not in (64, 128):
                raise ValueError(
                    f"MosaicGpuBlockSizes: {name} must be 64 or 128; got {getattr(self, name)!r}")
        if self.max_concurrent_steps not in (2, 3, 4):
            raise ValueError("MosaicGpuBlockSizes: max_concurrent_steps must be 2, 3 or 4; "
                             f"got {self.max_concurrent_steps!r}")

    @classmethod
    def default(cls, head_dim: int) -> "MosaicGpuBlockSizes":
        """Tiles for an H100 by head dim: the deepest ring that fits shared memory.

        A consumer keeps a (block_q, D) and a (block_q, block_k) float32 tile
        in registers (64 + 64 per thread at D = 128), so block_q stays 64.
        """
        if head_dim <= 64:
            return cls(block_q=64, block_k=128, max_concurrent_steps=3)
        if head_dim <= 128:
            return cls(block_q=64, block_k=128, max_concurrent_steps=2)
        return cls(block_q=64, block_k=64, max_concurrent_steps=2)

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory a program allocates: Q/O tiles, the K/V ring, row state."""
        q = 2 * self.block_q * head_dim * itemsize
        kv = 2 * self.max_concurrent_steps * self.block_k * head_dim * itemsize
        rows = 2 * 2 * self.block_q * 4
        return q + kv + rows


# ----------------------------------------------------------------------------------
# What the kernel takes
# ----------------------------------------------------------------------------------


def _static_classes(cfg, mask, block_rows, block_k):
    d = cfg.dims
    return masks.block_classes_static(mask, d.batch, d.num_q_heads, d.q_len, d.kv_len,
                                      block_rows, block_k, q_offset=cfg.q_offset)


def supports(cfg, dtype, mask, bias, sinks) -> list:
    """Why the spec cannot run on this kernel (empty: it can), from static facts.

    ``mask`` is the mask object (or None); ``bias`` and ``sinks`` are arrays or None.
    """
    d = cfg.dims
    why = []
    if bias is not None:
        why.append("a bias (the kernel adds nothing to the logits)")
    if sinks is not None:
        why.append("attention sinks")
    if cfg.dropout_rate > 0:
        why.append(f"dropout (rate {cfg.dropout_rate})")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        why.append(f"{jnp.dtype(dtype).name} inputs (the kernel takes float16 or bfloat16)")
    if d.head_dim != d.v_head_dim:
        why.append(f"a value head dim Dv={d.v_head_dim} unlike D={d.head_dim}")
    if isinstance(d.head_dim, int) and (d.head_dim % 64 or d.head_dim > 256):
        why.append(f"head dim D={d.head_dim} (the kernel takes multiples of 64 up to 256)")
    symbolic = _checks.symbolic_sizes(B=d.batch, Tq=d.q_len, Tk=d.kv_len)
    if symbolic:
        why.append(f"symbolic sizes {symbolic}")
    elif mask is not None:
        if mask.num_operands:
            why.append(f"a mask holding arrays ({mask!r}: segment ids, lengths, prefix "
                       "lengths, array masks)")
        elif _static_classes(cfg, mask, 128, 64) is None:
            why.append(f"a mask whose tile classes are not static ({mask!r})")
    return why


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when this process can compile the kernel (a Hopper GPU, compute
    capability 9.x, and Mosaic GPU importable), else why not. Asked when a
    program is traced for cuda, like cuDNN's presence."""
    try:
        _plgpu()
    except ImportError as e:
        return f"Mosaic GPU cannot be imported ({e})"
    try:
        gpus = jax.devices("gpu")
    except (RuntimeError, ValueError):  # (no GPU backend in this process)
        return "no GPU in this process"
    caps = {str(getattr(d, "compute_capability", "")) for d in gpus}
    if not caps or not all(c.startswith("9.") for c in caps):
        return f"the kernel needs a Hopper GPU (compute capability 9.x); found {sorted(caps)}"
    return None


def route(cfg, dtype, mask, bias, sinks) -> bool:
    """Whether impl="auto" on cuda runs this call's forward here (when cuDNN does
    not): every feature supported and a Hopper GPU present."""
    return not supports(cfg, dtype, mask, bias, sinks) and available() is None


def _refuse(cfg, dtype, mask, bias, sinks):
    why = supports(cfg, dtype, mask, bias, sinks)
    if why:
        raise NotImplementedError(
            f"flash: the Mosaic GPU kernel does not support {'; '.join(why)}; {_ELSEWHERE}.")


# ----------------------------------------------------------------------------------
# Static facts of one call
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything the kernel needs at trace time (hashable)."""

    G: int                # query heads per kv head
    Tk: int               # unpadded kv length (keys past it are not visible)
    offset: int           # aligned query position = row + offset
    bq: int               # rows per consumer warpgroup
    bk: int
    stages: int
    n_kv: int             # kv-tiles per row of the schedule (padded Tk // bk)
    D: int
    scale: float
    softcap: Optional[float]
    mask_treedef: object  # None without a mask
    ragged_k: bool
    sched_b: bool         # the schedule varies along batch / heads
    sched_h: bool
    interpreted: bool     # run by the Mosaic GPU interpreter

    @property
    def rows(self) -> int:
        return 2 * self.bq


def _compat_transpose(ref):
    """``ref`` seen with its two axes swapped, on either JAX's spelling."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return _plgpu().transpose_ref(ref, (1, 0))


def _kernel(q_ref, k_ref, v_ref, sched_ref, o_ref, m_ref, l_ref, *, P: _Plan, dtype):
    plgpu = _plgpu()
    ring = P.stages
    q_tiles = pl.cdiv(q_ref.shape[1], P.rows)

    def body(q_smem, k_smem, v_smem, m_smem, l_smem, q_ready, k_ready, v_ready, k_free,
             v_free, turn):
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        # Heaviest q-tiles (the last, under causal-like masks) start first.
        tile = q_tiles - 1 - lax.axis_index("tiles")
        wg = lax.axis_index("wg")
        row = (b if P.sched_b else 0, h if P.sched_h else 0, tile)
        n_full, n_seen = sched_ref[row + (0,)], sched_ref[row + (1,)]

        def kv_tile(t):
            return sched_ref[row + (2 + t,)]

        def slot_of(t):
            return lax.rem(t, jnp.int32(ring))

        def take_turn():
            # The two consumers alternate at this barrier: one runs its softmax
            # while the other's matrix multiplies occupy the tensor cores.
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _consume():
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
            mine = q_smem.at[wg]
            q0 = tile * P.rows + wg * P.bq
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, P.bq), h], mine, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            rows_layout = plgpu.Layout.WGMMA.reduce(1)
            m = _in_layout(jnp.full((P.bq,), -jnp.inf, F32), rows_layout, P)
            l = _in_layout(jnp.full((P.bq,), 0.0, F32), rows_layout, P)
            acc = _in_layout(jnp.full((P.bq, P.D), 0.0, F32), plgpu.Layout.WGMMA, P)

            @pl.when(n_seen > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(take_turn)

            def step(t, carry, partial: bool):
                acc, m, l = carry
                slot = slot_of(t)

                def scores(s_ref):
                    plgpu.wgmma(s_ref, mine, _compat_transpose(k_smem.at[slot]))
                    take_turn()
                    return s_ref[...]

                if P.interpreted:
                    # The interpreter's ``wgmma`` takes no transposed ref: the
                    # same product from the tiles in shared memory.
                    s = lax.dot_general(mine[...], k_smem.at[slot][...],
                                        (((1,), (1,)), ((), ())), preferred_element_type=F32)
                    take_turn()
                else:
                    s = pl.run_scoped(scores, plgpu.ACC((P.bq, P.bk), F32))
                plgpu.barrier_arrive(k_free.at[slot])
                if P.softcap is None:
                    c = P.scale * LOG2E
                else:  # softcap * tanh(scale * s / softcap), its factor folded into c
                    s = jnp.tanh(s * (P.scale / P.softcap))
                    c = P.softcap * LOG2E
                visible = _visible(q0, kv_tile(t), b, h, P) if partial else None
                if visible is not None:
                    s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                # A row that has seen no key keeps m = -inf; shifting it by 0
                # keeps its p at exp2(-inf) = 0 instead of NaN. FULL tiles come
                # first and see every key, so they need no such guard.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if partial else m_new
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p = p.astype(dtype)
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                def accumulate(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                    # Wait for the next K while this multiply runs.
                    @pl.when(t + 1 < n_seen)
                    def _():
                        plgpu.barrier_wait(k_ready.at[slot_of(t + 1)])

                if P.interpreted:
                    # The interpreter's ``wgmma`` takes no operand in registers:
                    # the same product from the tile in shared memory.
                    acc = acc + jnp.dot(p, v_smem.at[slot][...], preferred_element_type=F32)

                    @pl.when(t + 1 < n_seen)
                    def _():
                        plgpu.barrier_wait(k_ready.at[slot_of(t + 1)])
                else:
                    acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = lax.fori_loop(jnp.int32(0), n_full, functools.partial(step, partial=False),
                                  (acc, m, l))
            acc, m, l = lax.fori_loop(n_full, n_seen, functools.partial(step, partial=True),
                                      carry)
            pl.when(wg == 0)(take_turn)

            inv = 1.0 / jnp.where(l > 0, l, 1.0)
            mine[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            m_smem.at[wg][...] = m
            l_smem.at[wg][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(mine, o_ref.at[b, pl.ds(q0, P.bq), h])
            plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[b, h, pl.ds(q0, P.bq)])
            plgpu.copy_smem_to_gmem(l_smem.at[wg], l_ref.at[b, h, pl.ds(q0, P.bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _produce():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            kv_head = lax.div(h, jnp.int32(P.G))

            def issue(t, slot):
                rows = (b, pl.ds(kv_tile(t) * P.bk, P.bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

            for t in range(ring):  # fill the ring
                pl.when(t < n_seen)(functools.partial(issue, jnp.int32(t), t))

            def refill(t, _):
                slot = slot_of(t)
                rows = (b, pl.ds(kv_tile(t) * P.bk, P.bk), kv_head)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

            lax.fori_loop(jnp.int32(ring), jnp.maximum(n_seen, ring), refill, None)

            def drain(t, _):
                # Sees the ring's last hand-backs too, so every barrier phase is
                # observed before the barriers go (the interpreter checks it).
                plgpu.barrier_wait(k_free.at[slot_of(t)])
                plgpu.barrier_wait(v_free.at[slot_of(t)])

            lax.fori_loop(jnp.maximum(n_seen - ring, 0), n_seen, drain, None)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        body,
        plgpu.SMEM((2, P.bq, P.D), dtype, transforms=swizzled),
        plgpu.SMEM((ring, P.bk, P.D), dtype, transforms=swizzled),
        plgpu.SMEM((ring, P.bk, P.D), dtype, transforms=swizzled),
        plgpu.SMEM((2, P.bq), F32),
        plgpu.SMEM((2, P.bq), F32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=ring),
        plgpu.Barrier(num_barriers=ring),
        plgpu.Barrier(num_arrivals=2, num_barriers=ring),
        plgpu.Barrier(num_arrivals=2, num_barriers=ring),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )


def _in_layout(x, layout, P: _Plan):
    """``x`` placed in the register layout of ``wgmma`` results (a no-op for
    the interpreter, which has no layouts)."""
    return x if P.interpreted else _plgpu().layout_cast(x, layout)


def _iota(shape, axis, P: _Plan):
    if P.interpreted:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _visible(q0, j, b, h, P: _Plan):
    """Which keys of kv-tile ``j`` the consumer's rows ``q0 ..`` may see (WGMMA
    layout), or None for all of them (a tile PARTIAL only for padded rows)."""
    qi = q0 + _iota((P.bq, P.bk), 0, P)
    kj = j * P.bk + _iota((P.bq, P.bk), 1, P)
    ok = None
    if P.mask_treedef is not None:
        pos = masks.Positions(b=b, h=h, q=qi, q_pos=qi + P.offset, k=kj)
        ok = masks.from_treedef(P.mask_treedef).predicate(pos, [])
    if P.ragged_k:
        inside = kj < P.Tk
        ok = inside if ok is None else ok & inside
    return ok


# ----------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _schedule(treedef, batch, num_heads, q_len, kv_len, rows, bk, q_offset):
    """The kernel's visiting table as a read-only NumPy int32 array
    (B|1, H|1, q-tiles, 2 + kv-tiles): ``[n_full, n_visited, FULL tiles...,
    PARTIAL tiles..., repeats of the last]``."""
    mask = masks.from_treedef(treedef)
    cls = masks.block_classes_static(mask, batch, num_heads, q_len, kv_len, rows, bk,
                                     q_offset=q_offset)
    full = blocks.schedule_static(np.where(cls == masks.FULL, cls, masks.EMPTY))
    part = blocks.schedule_static(np.where(cls == masks.PARTIAL, cls, masks.EMPTY))
    n_kv = cls.shape[-1]
    cols = np.arange(n_kv)
    nf, n = full.count[..., None], (full.count + part.count)[..., None]
    # Slot t holds the t-th FULL tile, then the (t - n_full)-th PARTIAL one.
    from_part = np.take_along_axis(part.index, np.clip(cols - nf, 0, n_kv - 1), axis=-1)
    order = np.where(cols < nf, full.index, from_part)
    last = np.take_along_axis(order, np.maximum(n - 1, 0), axis=-1)
    order = np.where(cols < n, order, np.where(n > 0, last, 0))
    table = np.concatenate([nf, n, order], axis=-1).astype(np.int32)
    table.flags.writeable = False
    return table


def _hidden_keys_inert(k, v):
    """K and V such that a key a row may not see contributes nothing to it, whatever
    its bits. On PARTIAL tiles the kernel sets hidden logits to -inf (so a
    non-finite K is dropped there), but ``P @ V`` multiplies the zero weights by V
    itself and 0 * NaN is NaN. So the keys whose K or V holds a non-finite value
    get a NaN K (every row that sees them gets NaN, as in every lowering; rows
    that do not see them drop the logit) and their non-finite V entries become 0.
    One elementwise pass over K and V, only for masked specs (without a mask
    every visited key is seen by every row, and padding is zeros)."""
    k, v, bad = online.finite_keys(k, v)  # (bad: (B, T, Hkv), the keys' flags)
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, k.dtype), k), v


def _blocks_for(cfg):
    return blocks.pick(cfg.block_sizes, MosaicGpuBlockSizes,
                       MosaicGpuBlockSizes.default(cfg.dims.head_dim))


def forward(cfg, q, k, v, bias, sinks, mask, seed, *, interpret=False):
    """``(out, lse, lse_lo)`` of the flash forward on the Mosaic GPU kernel.

    The signature and results of every flash lowering's ``fwd``: "bthd" inputs,
    ``out`` (B, Tq, Hq, D) in q's dtype, ``lse`` and ``lse_lo`` (B, Hq, Tq)
    float32, lse in natural-log units. ``interpret``: False to compile for the
    GPU, or the parameters of the Mosaic GPU interpreter (:func:`interpret_params`)
    to run the same kernel on CPU.
    """
    del seed  # dropout is refused
    _refuse(cfg, q.dtype, mask, bias, sinks)
    plgpu = _plgpu()
    d = cfg.dims
    bs = _blocks_for(cfg)
    rows, bk = 2 * bs.block_q, bs.block_k
    Tqp, Tkp = -(-d.q_len // rows) * rows, -(-d.kv_len // bk) * bk
    treedef = None if mask is None else jax.tree_util.tree_structure(mask)
    table = _schedule(treedef, d.batch, d.num_q_heads, d.q_len, d.kv_len, rows, bk,
                      cfg.q_offset)
    n_kv = Tkp // bk
    P = _Plan(G=d.group, Tk=d.kv_len,
              offset=d.kv_len - d.q_len if cfg.q_offset is None else cfg.q_offset,
              bq=bs.block_q, bk=bk, stages=min(bs.max_concurrent_steps, max(n_kv, 1)),
              n_kv=n_kv, D=d.head_dim, scale=float(cfg.scale),
              softcap=None if cfg.softcap is None else float(cfg.softcap),
              mask_treedef=treedef, ragged_k=d.kv_len % bk != 0,
              sched_b=table.shape[0] > 1, sched_h=table.shape[1] > 1,
              interpreted=bool(interpret))
    rows_out = jax.ShapeDtypeStruct((d.batch, d.num_q_heads, Tqp), F32)
    call = plgpu.kernel(
        functools.partial(_kernel, P=P, dtype=q.dtype),
        out_type=(jax.ShapeDtypeStruct((d.batch, Tqp, d.num_q_heads, d.head_dim), q.dtype),
                  rows_out, rows_out),
        grid=(d.num_q_heads, Tqp // rows, d.batch),
        grid_names=("heads", "tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )
    if mask is not None:
        k, v = _hidden_keys_inert(k, v)
    out, m, l = call(triton._pad(q, 1, Tqp), triton._pad(k, 1, Tkp), triton._pad(v, 1, Tkp),
                     jnp.asarray(table))
    lse, lse_lo = online.lse_parts(m[:, :, :d.q_len], l[:, :, :d.q_len], log=jnp.log2,
                                   scale=LN2)
    return out[:, :d.q_len], lse, lse_lo


def interpret_params():
    """Parameters that run the kernel in the Mosaic GPU interpreter (on CPU)."""
    from jax._src.pallas.mosaic_gpu.interpret import params
    return params.InterpretGPUParams()


# The residuals are the Triton forward's: its dq and dk/dv kernels are the backward.
LOWERING = Lowering("flash-mosaic-gpu", functools.partial(forward, interpret=False),
                    triton.LOWERING.bwd)
