"""benchmarks/decode_forms.py on a tiny problem: it times the forms it names
(both compute the same function) and leaves fnattn's form choice as it was."""

import jax
import jax.numpy as jnp
import numpy as np
from benchmark_scripts import benchmark_module

from fnattn import AttentionSpec, masks
from fnattn.decoding import xla


def test_main_writes_a_table_of_the_named_forms(tmp_path):
    forms = benchmark_module("decode_forms")
    forms.main(["--grid", "2x128x2x2x8", "--forms", "mixed,dot", "--out",
                str(tmp_path / "forms")])
    lines = (tmp_path / "forms.md").read_text().splitlines()
    head, rule, body = lines[-3:]
    assert "| mixed | dot | fastest |" in head
    assert head.count("|") == rule.count("|") == body.count("|") == 14
    assert body.startswith("| float32 | 2 | 128 | 2 | 2 | 8 |")


def test_forms_are_the_same_function_and_the_choice_is_restored():
    forms = benchmark_module("decode_forms")
    choose = xla.choose
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, 1, 4, 8))
    k = jax.random.normal(ks[1], (2, 128, 2, 8))
    v = jax.random.normal(ks[2], (2, 128, 2, 8))
    args = (q, k, v, jnp.array([100, 7], jnp.int32))
    spec = AttentionSpec(mask=masks.causal(), impl="xla")
    outs = {form: forms.compiled(form, spec, args)(*args) for form in ("mixed", "reduce")}
    assert xla.choose is choose
    np.testing.assert_allclose(outs["mixed"], outs["reduce"], atol=1e-6)
    r = forms.row(jnp.float32, 2, 128, 2, 2, 8, rounds=1)
    assert set(r["t"]) == {"mixed", "reduce", "jax.nn"} and r["chosen"] == "mixed"
    assert forms.line(r).count("|") == 14
    # other forms and split counts, and the picked form timed even when not named
    r = forms.row(jnp.float32, 2, 128, 2, 2, 8, rounds=1, forms=("dot", "mixed/1"))
    assert set(r["t"]) == {"dot", "mixed/1", "mixed", "jax.nn"}
    assert forms.line(r).count("|") == 14 and "| mixed |" in forms.line(r)
    outs = {f: forms.compiled(f, spec, args)(*args) for f in ("dot", "mixed/1", "reduce/4")}
    for out in outs.values():
        np.testing.assert_allclose(out, outs["dot"], atol=1e-6)
