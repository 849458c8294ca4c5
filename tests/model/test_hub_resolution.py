"""Models and tokenizers by hub id, resolved offline from a cache in the hub's layout (a temp
dir; nothing downloads): snapshots, revisions, GGUF files by quant type, clear errors."""
import shutil
from pathlib import Path

import pytest

from kiln.model.loader.hub import HubName, parse_hub_name, pick_gguf_file, resolve_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def add_to_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str = COMMIT,
                 ref: str | None = "main") -> Path:
    """Put `files` (name -> source file or bytes) into `cache` as the hub lays a snapshot out:
    blobs, snapshots/<commit>/ linking to them, refs/<ref> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        data = src.read_bytes() if isinstance(src, Path) else src
        blob = repo / "blobs" / f"{abs(hash((name, commit))):x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / blob.name)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in model_dir.iterdir() if p.is_file()}


def test_cache_dir_follows_the_hub_variables(tmp_path, monkeypatch):
    from kiln.model.loader.hub import hub_cache_dir

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"
    assert hub_cache_dir("~/dl") == Path("~/dl").expanduser()


def test_parse_hub_names():
    assert parse_hub_name("org/name") == HubName("org/name")
    assert parse_hub_name("gpt2") == HubName("gpt2")
    assert parse_hub_name("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == HubName(
        "unsloth/Qwen3-0.6B-GGUF", quant="Q4_K_M")
    assert parse_hub_name("org/repo/sub/m.gguf") == HubName("org/repo", filename="sub/m.gguf")
    for not_hub in ("./model", "/abs/path", "~/m", "a/b/c", "org/../x", "org/name:bad quant"):
        assert parse_hub_name(not_hub) is None, not_hub


def test_hub_id_resolves_from_the_cache_offline_and_runs(tiny_llama_dir, offline_cache):
    from kiln import LLM, SamplingParams

    snapshot = add_to_cache(offline_cache, "kiln-test/tiny-llama", checkpoint_files(tiny_llama_dir))
    assert resolve_path("kiln-test/tiny-llama") == snapshot
    llm = LLM(model="kiln-test/tiny-llama", enforce_eager=True, max_model_len=64)
    try:
        mc = llm.llm_engine.model_config
        assert mc.model_path == snapshot and mc.tokenizer_path == snapshot
        ids = [5, 6, 7, 8]
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4,
                                                                    ignore_eos=True),
                           use_tqdm=False)
        local = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64)
        want = local.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        local.shutdown()
        assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_revision_download_dir_and_tokenizer_by_hub_id(tiny_llama_dir, tmp_path, monkeypatch):
    from kiln.config import ModelConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # --download-dir wins
    cache = tmp_path / "dl"
    files = checkpoint_files(tiny_llama_dir)
    main = add_to_cache(cache, "kiln-test/tiny", files)
    tagged = add_to_cache(cache, "kiln-test/tiny", files, commit=OTHER, ref=None)
    tok_files = {n: p for n, p in files.items() if n.startswith(("tokenizer", "special"))}
    tok_snapshot = add_to_cache(cache, "kiln-test/tok", tok_files)
    mc = ModelConfig(model="kiln-test/tiny", download_dir=str(cache))
    assert mc.model_path == main
    mc = ModelConfig(model="kiln-test/tiny", revision=OTHER, download_dir=str(cache),
                     tokenizer="kiln-test/tok")
    assert mc.model_path == tagged and mc.tokenizer_path == tok_snapshot


def test_gguf_file_by_quant_type_or_path(offline_cache):
    snapshot = add_to_cache(offline_cache, "kiln-test/m-GGUF", {
        "m-Q4_K_M.gguf": b"GGUF", "m-Q8_0.gguf": b"GGUF", "sub/m-f16.gguf": b"GGUF"})
    assert resolve_path("kiln-test/m-GGUF:Q4_K_M") == snapshot / "m-Q4_K_M.gguf"
    assert resolve_path("kiln-test/m-GGUF:q8_0") == snapshot / "m-Q8_0.gguf"
    assert resolve_path("kiln-test/m-GGUF/sub/m-f16.gguf") == snapshot / "sub" / "m-f16.gguf"
    with pytest.raises(FileNotFoundError, match="Q5_K_M.*m-Q4_K_M.gguf"):
        pick_gguf_file(HubName("kiln-test/m-GGUF", quant="Q5_K_M"), ["m-Q4_K_M.gguf"])
    with pytest.raises(FileNotFoundError, match="single-file"):
        pick_gguf_file(HubName("r", quant="Q4_0"), ["a-Q4_0.gguf", "b-Q4_0.gguf"])


def test_missing_model_offline_is_a_clear_error(offline_cache, tiny_llama_dir):
    from kiln.config import ModelConfig

    with pytest.raises(FileNotFoundError) as e:
        ModelConfig(model="kiln-test/not-there")
    message = str(e.value)
    assert "kiln-test/not-there" in message and "HF_HUB_OFFLINE" in message
    assert str(offline_cache) in message and "--model" in message
    # A quant the cached repo lacks is not found either; nor is an unknown revision.
    add_to_cache(offline_cache, "kiln-test/g", {"g-Q4_0.gguf": b"GGUF"})
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_path("kiln-test/g:Q8_0")
    add_to_cache(offline_cache, "kiln-test/tiny", checkpoint_files(tiny_llama_dir))
    with pytest.raises(FileNotFoundError, match="kiln-test/tiny@v9"):
        resolve_path("kiln-test/tiny", revision="v9")


def test_a_local_path_wins_and_a_non_hub_name_says_so(tmp_path, offline_cache, tiny_llama_dir):
    local = tmp_path / "org" / "name"
    shutil.copytree(tiny_llama_dir, local)
    assert resolve_path(str(local)) == local
    with pytest.raises(FileNotFoundError, match="not a Hugging Face hub id"):
        resolve_path("./nowhere/model")


def test_online_a_cache_miss_downloads_into_the_cache(tmp_path, monkeypatch, tiny_llama_dir):
    """The hub's network calls replaced by ones that fill the cache as the hub would: a miss
    asks for the snapshot (allowed files only) or, for a quant, the one file."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    remote = {"kiln-test/tiny": checkpoint_files(tiny_llama_dir),
              "kiln-test/g": {"g-Q4_0.gguf": b"GGUF", "g-Q8_0.gguf": b"GGUF"}}
    calls = []

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False,
                          allow_patterns=None, **_):
        calls.append(("snapshot", repo_id, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        import fnmatch
        files = {n: s for n, s in remote[repo_id].items()
                 if any(fnmatch.fnmatch(n, p) for p in allow_patterns)}
        return str(add_to_cache(Path(cache_dir), repo_id, files))

    def hf_hub_download(repo_id, filename, *, revision=None, cache_dir=None, **_):
        calls.append(("file", repo_id, filename))
        return str(add_to_cache(Path(cache_dir), repo_id, {filename: remote[repo_id][filename]})
                   / filename)

    class Api:
        def list_repo_files(self, repo_id, revision=None):
            return list(remote[repo_id])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    path = resolve_path("kiln-test/tiny")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert calls == [("snapshot", "kiln-test/tiny", True), ("snapshot", "kiln-test/tiny", False)]
    calls.clear()
    assert resolve_path("kiln-test/g:Q8_0").name == "g-Q8_0.gguf"
    assert ("file", "kiln-test/g", "g-Q8_0.gguf") in calls
    assert not (path.parent.parent.parent / "models--kiln-test--g" / "snapshots" / COMMIT
                / "g-Q4_0.gguf").exists()  # only the named quant was fetched
