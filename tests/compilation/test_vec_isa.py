"""The vector-ISA verdict: probed once per machine, then read back instead of probing, and
never set when the user decided, the cache is off, or a candidate failed."""
import json
import platform

import pytest
from torch._inductor import config

from kiln.compilation import vec_isa
from kiln.compilation.compiler_interface import InductorStandaloneAdaptor

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="Inductor probes vector ISAs on x86 only")


@pytest.fixture(autouse=True)
def _inductor_flag(monkeypatch):
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    with config.patch({"cpp.vec_isa_ok": None}):  # restored after the test
        yield


def test_probe_once_then_read_the_verdict(tmp_path, monkeypatch):
    probes, real = [], vec_isa._probed_equals_assumed
    monkeypatch.setattr(vec_isa, "_probed_equals_assumed", lambda: probes.append(1) or real())
    assert vec_isa.settle(tmp_path) and config.cpp.vec_isa_ok is True
    (verdict,) = tmp_path.iterdir()
    assert verdict.name == f"{vec_isa.machine_key()}.json" and probes == [1]
    config.cpp.vec_isa_ok = None  # a new process
    assert vec_isa.settle(tmp_path) and config.cpp.vec_isa_ok is True
    assert probes == [1]  # read back, not probed again


def test_damaged_verdict_is_probed_and_written_again(tmp_path, kiln_logs):
    verdict = tmp_path / f"{vec_isa.machine_key()}.json"
    for damage in ("garbage{", "[]"):
        verdict.write_text(damage)
        config.cpp.vec_isa_ok = None
        assert vec_isa.settle(tmp_path) and config.cpp.vec_isa_ok is True
        assert json.loads(verdict.read_text()) == {"all_candidates_pass": True}
    assert "verdict" in kiln_logs.text and "damaged" in kiln_logs.text


def test_cache_key_is_the_same_whoever_probed(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    probing = InductorStandaloneAdaptor(device="cpu").compute_hash()  # probes, writes
    config.cpp.vec_isa_ok = None
    reading = InductorStandaloneAdaptor(device="cpu").compute_hash()  # reads the verdict
    assert probing == reading and config.cpp.vec_isa_ok is True


def test_left_alone_when_decided_elsewhere_or_failed(tmp_path, monkeypatch):
    (tmp_path / f"{vec_isa.machine_key()}.json").write_text(
        json.dumps({"all_candidates_pass": False}))
    assert not vec_isa.settle(tmp_path) and config.cpp.vec_isa_ok is None
    other = tmp_path / "other"
    monkeypatch.setattr(vec_isa, "_probed_equals_assumed", lambda: False)  # a candidate failed
    assert not vec_isa.settle(other) and not other.exists()
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    assert not vec_isa.settle(other)
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE")
    config.cpp.vec_isa_ok = False  # the user's TORCHINDUCTOR_VEC_ISA_OK=0
    assert not vec_isa.settle(other) and config.cpp.vec_isa_ok is False


def test_only_cpu_compiles_settle_the_probe(monkeypatch):
    calls = []
    monkeypatch.setattr(vec_isa, "settle", lambda: calls.append(1))
    InductorStandaloneAdaptor(device="cuda").compute_hash()
    assert calls == []
    InductorStandaloneAdaptor(device="cpu").compute_hash()
    assert calls == [1]


def test_extension_probes_are_remembered_in_the_verdict(tmp_path):
    from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa

    assert vec_isa.settle(tmp_path)
    isa = pick_vec_isa()
    assert VecISA.check_build(isa, VecISA._avx_code) is True  # probed, then recorded
    verdict = tmp_path / f"{vec_isa.machine_key()}.json"
    (key, built), = json.loads(verdict.read_text())["builds"].items()
    assert built is True
    # Read back, not probed again: a recorded answer is what the next process gets.
    verdict.write_text(json.dumps({"all_candidates_pass": True, "builds": {key: False}}))
    assert VecISA.check_build(isa, VecISA._avx_code) is False
    verdict.unlink()  # no verdict: Inductor's own probe answers
    assert VecISA.check_build(isa, VecISA._avx_code) is True


def test_a_recorded_probe_of_the_wrong_shape_is_probed_again(tmp_path):
    """Valid JSON of another shape failed every compile with a TypeError from the probe's
    lookup, on every start (helper-25)."""
    from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa

    assert vec_isa.settle(tmp_path)
    verdict = tmp_path / f"{vec_isa.machine_key()}.json"
    for damage in ({"all_candidates_pass": True, "builds": [1]}, [1, 2]):
        verdict.write_text(json.dumps(damage))
        assert VecISA.check_build(pick_vec_isa(), VecISA._avx_code) is True


def test_a_process_that_let_inductor_probe_keeps_doing_so(tmp_path, monkeypatch):
    # A failed first settle (here: no compiler identity) followed by a working one would change
    # Inductor's config hash, so the compile cache key, between two compiles of one process.
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vec_isa, "_gave_up", {"root": None}, raising=False)
    key = vec_isa.machine_key()
    monkeypatch.setattr(vec_isa, "machine_key", lambda: 1 / 0)
    before = InductorStandaloneAdaptor(device="cpu").compute_hash()
    monkeypatch.setattr(vec_isa, "machine_key", lambda: key)
    assert not vec_isa.settle() and config.cpp.vec_isa_ok is None
    assert InductorStandaloneAdaptor(device="cpu").compute_hash() == before
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "other"))  # another root decides anew
    assert vec_isa.settle() and config.cpp.vec_isa_ok is True
