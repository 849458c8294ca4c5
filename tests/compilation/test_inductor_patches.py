"""Kiln's patches to torch internals: loads hand Inductor the plain kernel header (no
preprocessor run, no 156 MB `.gch` build); every patched internal exists in this torch, and
one that is missing is refused with an error naming the patch and the versions checked."""
from pathlib import Path

import pytest
from torch._inductor import codecache

from kiln.compilation import inductor_patches
from kiln.compilation.inductor_patches import (
    PATCHES,
    TorchInternalMissing,
    check_all,
    forget_backend,
    headers_not_precompiled,
    plain_header_path,
)

HEADER = "torch/csrc/inductor/cpp_prefix.h"


def test_lookup_returns_the_shipped_header_inside_the_block_only():
    real = codecache._precompile_header
    with headers_not_precompiled():
        path = codecache._precompile_header(HEADER, "g++ -O3 ...", device_type="cpu")
    assert path == plain_header_path(HEADER) and Path(path).read_text().strip()
    assert path.endswith(HEADER) and codecache._precompile_header is real


def test_unknown_header_falls_back_to_inductor(monkeypatch):
    calls = []
    monkeypatch.setattr(codecache, "_precompile_header", lambda *a, **k: calls.append(a) or "x.h")
    with headers_not_precompiled():
        assert codecache._precompile_header("no/such/header.h", "cmd") == "x.h"
    assert calls == [("no/such/header.h", "cmd")]


def test_every_patched_internal_exists_in_this_torch():
    check_all()
    assert all(p.checked_on and p.why for p in PATCHES)


def test_a_missing_internal_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(codecache, "_precompile_header")
    with pytest.raises(TorchInternalMissing, match=r"'headers_not_precompiled' needs "
                       r"torch\._inductor\.codecache\._precompile_header.*checked against"):
        with headers_not_precompiled():
            pass
    with pytest.raises(TorchInternalMissing, match="headers_not_precompiled"):
        check_all()


def test_a_missing_isa_probe_is_refused_by_name(monkeypatch):
    from torch._inductor.cpu_vec_isa import VecISA

    monkeypatch.setitem(inductor_patches._isa_probe, "installed", False)
    monkeypatch.delattr(VecISA, "check_build")
    with pytest.raises(TorchInternalMissing, match=r"remember_isa_build_probes.*VecISA\.check_"):
        inductor_patches.remember_isa_build_probes(lambda isa, code, probe: True)


def test_forget_backend_drops_only_that_backend(monkeypatch):
    from torch._dynamo import eval_frame

    def mine(gm, inputs):
        return gm

    def other(gm, inputs):
        return gm

    monkeypatch.setattr(eval_frame, "cached_backends", {1: mine, 2: other})
    forget_backend(mine)
    assert eval_frame.cached_backends == {2: other}
    monkeypatch.delattr(eval_frame, "cached_backends")
    with pytest.raises(TorchInternalMissing, match="forget_backend"):
        forget_backend(other)


def test_kernel_templates_build_their_jinja2_template_on_first_render():
    inductor_patches.lazy_kernel_templates()
    from torch._inductor.codegen.common import KernelTemplate

    template = KernelTemplate._template_from_string("{{ a }}|{{ b | indent_except_first(1) }}")
    assert isinstance(template, inductor_patches.LazyTemplate) and template._template is None
    assert template.render(a=1, b="x\ny") == "1|x\n    y"  # Inductor's own filter, too
    built = template._template
    assert template.render(a=2, b="z") == "2|z" and template._template is built
    broken = KernelTemplate._template_from_string("{% if %}")
    with pytest.raises(Exception, match="line 1"):  # the syntax error, at first use
        broken.render()
