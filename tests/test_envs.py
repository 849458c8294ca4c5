"""kiln/envs.py: the environment variables Kiln reads."""
from pathlib import Path

from kiln import envs


def test_an_empty_cache_root_means_the_default(monkeypatch, tmp_path):
    """KILN_CACHE_ROOT="" cached into the working directory (Path("") is "."), where every
    other variable treats empty as unset (helper-25)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KILN_CACHE_ROOT", "")
    assert envs.cache_root() == tmp_path / "kiln"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert envs.cache_root() == Path.home() / ".cache" / "kiln"
