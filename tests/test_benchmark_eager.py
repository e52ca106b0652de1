"""benchmarks/eager.py on tiny shapes: every row runs and the table is written."""

from benchmark_scripts import benchmark_module


def test_small_run_writes_every_row(tmp_path):
    eager = benchmark_module("eager")
    eager.main(["--small", "--out", str(tmp_path / "eager")])
    lines = (tmp_path / "eager.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| fnattn") or line.startswith("| jax")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| fnattn.attention, causal", "| fnattn.attention, documents + sinks",
        "| fnattn.decode", "| fnattn.paged_attention", "| jax.grad of fnattn.attention, causal",
        "| jax.vmap of fnattn.attention, causal", "| jax.nn.dot_product_attention, causal",
        "| jax.grad of jax.nn.dot_product_attention, causal"]
    assert all(r.count("|") == 6 for r in rows)
