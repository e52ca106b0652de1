"""``python -m fnattn`` (fnattn/__main__.py), the README's first command, at the
small sizes of ``--quick``."""

import pytest

import fnattn
from fnattn import __main__ as demo


def test_quick_run_checks_every_variant_and_passes(capsys):
    demo.main(["--quick"])
    out = capsys.readouterr().out
    for name, _, _ in demo.VARIANTS:
        assert f"\n{name} " in out, name
    assert "jax.jvp of attention impl=auto   PASS" in out
    assert "ring (zigzag), causal            PASS" in out
    assert "decode (contiguous cache)        PASS" in out
    assert "paged_attention (page 16)        PASS" in out
    assert "FAIL" not in out and out.rstrip().endswith("all checks passed")


def test_a_variant_that_disagrees_with_the_reference_fails_the_run(monkeypatch, capsys):
    def off(spec, q, k, v):
        return fnattn.attention(spec, q, k, v).out * 1.01

    monkeypatch.setattr(demo, "VARIANTS", (("off by 1 %", off, {}),))
    for section in ("forward_mode", "context_parallel", "serving"):
        monkeypatch.setattr(demo, section, lambda *args: False)
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--quick"])
    out = capsys.readouterr().out
    assert exit_.value.code == 1
    assert "off by 1 %" in out and "FAIL (" in out and "SOME CHECKS FAILED" in out


def test_unknown_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--fast"])
    assert exit_.value.code == 2 and "unrecognized arguments: --fast" in capsys.readouterr().err
