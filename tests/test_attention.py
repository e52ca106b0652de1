"""fnattn.attention, the entry point: lowerings agree, and it composes with jit,
grad, vmap (spec included), checkpoint and scan.

Lowering-by-lowering comparisons with float64 NumPy live in test_reference.py,
test_xla.py, test_cudnn.py and tests/flash/.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnattn
from fnattn import AttentionSpec, masks
from cases import CASES, make
from np_attention import np_attention

IMPLS = ["auto", "xla", "reference"]


def _rand(rs, *shape):
    return jnp.asarray(rs.standard_normal(shape), jnp.float32)


def _problem(B=3, Tq=7, Tk=11, Hq=6, Hkv=2, D=5, Dv=3, seed=0):
    """A spec whose every array has a leading batch axis (or none), and q, k, v."""
    rs = np.random.default_rng(seed)
    q, k, v = _rand(rs, B, Tq, Hq, D), _rand(rs, B, Tk, Hkv, D), _rand(rs, B, Tk, Hkv, Dv)
    q_ids = jnp.asarray(np.sort(rs.integers(0, 3, (B, Tq)), 1))
    kv_ids = jnp.asarray(np.sort(rs.integers(0, 3, (B, Tk)), 1))
    mask = (masks.causal() & masks.segments(q_ids, kv_ids)
            | masks.lengths(kv_lengths=jnp.array([2, 0, 5][:B])))
    spec = AttentionSpec(mask=mask, bias=_rand(rs, B, Hq, Tq, Tk), sinks=_rand(rs, Hq),
                         softcap=3.0)
    return spec, q, k, v


@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_lowerings_agree_with_the_reference(impl):
    spec, q, k, v = _problem()
    a = jax.jit(fnattn.attention)(spec.replace(impl=impl), q, k, v)
    r = jax.jit(fnattn.attention)(spec.replace(impl="reference"), q, k, v)
    np.testing.assert_allclose(np.asarray(a.out), np.asarray(r.out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(a.lse), np.asarray(r.lse), atol=2e-5, rtol=2e-5)


def test_reference_impl_is_the_reference():
    spec, q, k, v = _problem()
    a = jax.jit(fnattn.attention)(spec.replace(impl="reference"), q, k, v)
    r = jax.jit(fnattn.reference)(spec, q, k, v)
    np.testing.assert_array_equal(np.asarray(a.out), np.asarray(r.out))


def _split_batch(spec, B):
    """Adds a unit axis after the batch axis of every batched array; returns in_axes."""
    def split(x):
        return x[:, None] if x.shape[0] == B else x

    def axis(x):
        return 0 if x.shape[0] == B else None

    arrays = spec.replace(dropout_key=None)
    return (jax.tree_util.tree_map(split, arrays), jax.tree_util.tree_map(axis, arrays))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_batch_equals_the_batched_call(impl):
    B = 3
    spec, q, k, v = _problem(B=B)
    spec = spec.replace(impl=impl)
    batched = jax.jit(fnattn.attention)(spec, q, k, v)
    per_spec, spec_axes = _split_batch(spec, B)
    assert spec_axes.sinks is None and spec_axes.bias == 0
    f = jax.jit(jax.vmap(fnattn.attention, in_axes=(spec_axes, 0, 0, 0)))
    res = f(per_spec, q[:, None], k[:, None], v[:, None])
    np.testing.assert_allclose(np.asarray(res.out[:, 0]), np.asarray(batched.out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(res.lse[:, 0]), np.asarray(batched.lse), atol=1e-5)


def test_vmap_of_grad_equals_grad_of_the_batched_call():
    B = 3
    spec, q, k, v = _problem(B=B, seed=1)
    spec = spec.replace(impl="xla")
    per_spec, spec_axes = _split_batch(spec, B)

    def loss(spec, q, k, v):
        r = fnattn.attention(spec, q, k, v)
        return jnp.sum(r.out ** 2) + jnp.sum(jnp.where(jnp.isfinite(r.lse), r.lse, 0.0))

    g_batched = jax.jit(jax.grad(loss, argnums=(1, 2, 3)))(spec, q, k, v)
    g_vmapped = jax.jit(jax.vmap(jax.grad(loss, argnums=(1, 2, 3)),
                                 in_axes=(spec_axes, 0, 0, 0)))(
        per_spec, q[:, None], k[:, None], v[:, None])
    for a, b in zip(g_vmapped, g_batched):
        np.testing.assert_allclose(np.asarray(a[:, 0]), np.asarray(b), atol=1e-5, rtol=1e-5)


# impl="auto" (flash) under checkpoint and scan is tested in tests/flash/.
@pytest.mark.parametrize("impl", ["xla"])
def test_checkpoint_and_scan_over_layers(impl):
    B, T, H, D, L = 2, 7, 3, 5, 3
    rs = np.random.default_rng(0)
    x = _rand(rs, B, T, H, D)
    ws = _rand(rs, L, D, D) * 0.3
    sinks = _rand(rs, H)

    def loss(ws, sinks, impl, remat):
        spec = AttentionSpec(mask=masks.causal(), sinks=sinks, impl=impl)

        def layer(h, w):
            y = jnp.einsum("bthd,de->bthe", h, w)
            r = fnattn.attention(spec, y, y, y)
            return h + r.out + 0.1 * jnp.swapaxes(r.lse, 1, 2)[..., None], None

        f = jax.checkpoint(layer) if remat else layer
        return jnp.sum(jax.lax.scan(f, x, ws)[0] ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(grad, static_argnums=(2, 3))(ws, sinks, "reference", False)
    for remat in (True, False):
        got = jax.jit(grad, static_argnums=(2, 3))(ws, sinks, impl, remat)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_return_lse_false(impl):
    q = jnp.ones((1, 3, 2, 5))
    res = jax.jit(fnattn.attention)(AttentionSpec(return_lse=False, impl=impl), q, q, q)
    assert res.lse is None and res.out.shape == q.shape


def test_output_is_a_pytree():
    q = jnp.ones((1, 3, 2, 5))
    res = jax.jit(fnattn.attention)(AttentionSpec(impl="xla"), q, q, q)
    leaves, treedef = jax.tree_util.tree_flatten(res)
    assert len(leaves) == 2
    assert jax.tree_util.tree_unflatten(treedef, leaves).out.shape == (1, 3, 2, 5)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_layouts_agree(impl):
    case = [c for c in CASES if c.name == "everything"][0]
    spec, q, k, v, _ = make(case, impl=impl)
    spec_t, qt, kt, vt, _ = make(case, impl=impl, layout="bhtd")
    a = jax.jit(fnattn.attention)(spec, q, k, v)
    b = jax.jit(fnattn.attention)(spec_t, qt, kt, vt)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(b.out, 1, 2)), np.asarray(a.out),
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(b.lse), np.asarray(a.lse), atol=1e-6)


def test_masks_built_from_traced_arrays_do_not_retrace():
    traces = []

    @jax.jit
    def f(ids, lengths, q):
        traces.append(1)
        spec = AttentionSpec(mask=masks.segments(ids) & masks.lengths(kv_lengths=lengths),
                             impl="xla")
        return fnattn.attention(spec, q, q, q).out

    rs = np.random.default_rng(5)
    q = _rand(rs, 2, 7, 3, 5)
    a = f(jnp.zeros((2, 7), jnp.int32), jnp.array([7, 7]), q)
    b = f(jnp.asarray(rs.integers(0, 2, (2, 7))), jnp.array([3, 5]), q)
    assert len(traces) == 1
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_calls_outside_jit_compile_once_per_shapes_and_configuration(monkeypatch):
    """Outside jit an entry point runs compiled, traced once per tree, static
    configuration and shapes: a second call with new arrays (segment ids, sinks,
    q) reuses the program, and gives what jax.jit gives."""
    from fnattn import core
    traces = []
    run = core.run
    monkeypatch.setattr(core, "run", lambda *a, **kw: traces.append(1) or run(*a, **kw))
    rs = np.random.default_rng(6)
    q, k = _rand(rs, 2, 9, 4, 8), _rand(rs, 2, 9, 2, 8)

    def spec(seed, **kw):
        r = np.random.default_rng(seed)
        return AttentionSpec(mask=masks.causal() & masks.segments(
            jnp.asarray(np.sort(r.integers(0, 3, (2, 9)), 1), jnp.int32)),
            sinks=jnp.asarray(r.standard_normal(4), jnp.float32), **kw)

    jax.clear_caches()   # (a test before it in this process may have traced these shapes)
    first = fnattn.attention(spec(0), q, k, k)
    second = fnattn.attention(spec(1), q * 2, k, k)
    assert len(traces) == 1
    for s, x, res in ((spec(0), q, first), (spec(1), q * 2, second)):
        want = jax.jit(fnattn.attention)(s, x, k, k)
        np.testing.assert_allclose(res.out, want.out, atol=1e-6)
    n = len(traces)                                           # (jit traced it once more)
    fnattn.attention(spec(0, softcap=5.0), q, k, k)          # a new configuration
    fnattn.attention(spec(0), q[..., :4], k[..., :4], k)      # new shapes
    fnattn.attention(spec(2), q, k, k)                        # neither
    assert len(traces) == n + 2
    with jax.disable_jit():                                   # op by op, as asked
        np.testing.assert_allclose(fnattn.attention(spec(0), q, k, k).out, first.out,
                                   atol=1e-5)
    assert len(traces) == n + 3


def test_eager_grad_and_vmap_compile_once(monkeypatch):
    """An eager jax.grad or jax.vmap of an entry point runs its jax.jit too:
    traced once per shapes (it used to run operation by operation, compiling
    each loop at every call), with the results of the jitted transformation."""
    from fnattn import core
    traces = []
    run = core.run
    monkeypatch.setattr(core, "run", lambda *a, **kw: traces.append(1) or run(*a, **kw))
    spec = AttentionSpec(mask=masks.causal())
    grad = jax.grad(lambda q, k: fnattn.attention(spec, q, k, k).out.sum())
    vmap = jax.vmap(lambda q, k: fnattn.attention(spec, q[None], k[None], k[None]).out)
    for f in (grad, vmap):
        jax.clear_caches()   # (a test before it in this process may have traced these shapes)
        rs = np.random.default_rng(9)
        args = [(_rand(rs, 2, 8, 4, 8), _rand(rs, 2, 8, 2, 8)) for _ in range(3)]
        got = [f(*a) for a in args]
        assert len(traces) == 1, f
        for a, g in zip(args, got):
            np.testing.assert_allclose(g, jax.jit(f)(*a), atol=1e-5)
        traces.clear()


def test_masks_of_the_same_fields_never_share_a_program():
    """``masks.full()`` and ``masks.causal()`` (dataclass nodes without fields,
    whose treedefs jax 0.10 holds equal) each get their own program, outside
    jit and inside one: the second call of an entry point once returned the
    first one's result."""
    rs = np.random.default_rng(8)
    q, k = _rand(rs, 1, 6, 2, 4), _rand(rs, 1, 6, 2, 4)
    tril = np.tril(np.ones((6, 6), bool))
    cases = [(masks.full(), None), (masks.causal(), tril),
             (masks.full() & masks.causal(), tril), (masks.causal() & masks.full(), tril),
             (masks.full() | masks.causal(), None)]
    want = [np_attention(q, k, k, mask=m)[0] for _, m in cases]
    for fn in (fnattn.attention, fnattn.reference, fnattn.flash):
        calls = lambda q, k: [fn(AttentionSpec(mask=m), q, k, k).out for m, _ in cases]  # noqa: E731
        for got in (calls(q, k), jax.jit(calls)(q, k)):
            for (m, _), g, w in zip(cases, got, want):
                np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"{fn.__name__} {m}")


def test_disable_jit_runs_every_entry_point():
    """Under jax.disable_jit() (debugging op by op) the entry points give what
    they give under jit; the platform choice used to bind itself again there
    until Python's recursion limit."""
    rs = np.random.default_rng(7)
    q, k = _rand(rs, 2, 8, 4, 8), _rand(rs, 2, 8, 2, 8)
    spec = AttentionSpec(mask=masks.causal(), sinks=jnp.asarray(rs.standard_normal(4),
                                                                 jnp.float32))
    L = jnp.array([5, 8])
    pages = k.transpose(2, 0, 1, 3).reshape(2, 4, 4, 8)        # (Hkv, pages, 4, D)
    table = jnp.array([[0, 1], [2, 3]], jnp.int32)
    calls = {
        "attention": lambda q, k: fnattn.attention(spec, q, k, k).out,
        "decode": lambda q, k: fnattn.decode(spec, q[:, :1], k, k, kv_lengths=L).out,
        "paged_attention": lambda q, k: fnattn.paged_attention(
            spec, q[:, :1], pages, pages, page_table=table, kv_lengths=L).out,
        "grad": jax.grad(lambda q, k: fnattn.attention(spec, q, k, k).out.sum()),
    }
    for name, f in calls.items():
        with jax.disable_jit():
            got = f(q, k)
        np.testing.assert_allclose(got, jax.jit(f)(q, k), atol=1e-5, err_msg=name)
