"""Models and tokenizers named by Hugging Face hub id: found in the local hub cache first, else
downloaded (unless HF_HUB_OFFLINE); `org/repo:QUANT` names one GGUF file of a repo, as vLLM's.
"""
import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

# What a checkpoint or a tokenizer needs from a repo (weights are safetensors or one GGUF).
_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
_MODEL_PATTERNS = [*_TOKENIZER_PATTERNS, "*.safetensors"]
# A hub repo id as the hub accepts it: [org/]name of letters, digits, "-", "_", ".".
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
_TRUE = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class HubName:
    """A model named on the hub: a repo, optionally one GGUF file in it (by quant or path)."""
    repo_id: str
    quant: str | None = None  # "Q4_K_M" of "org/repo:Q4_K_M"
    filename: str | None = None  # "sub/model.gguf" of "org/repo/sub/model.gguf"


def parse_hub_name(name: str) -> HubName | None:
    """The hub repo (and GGUF file) a --model / --tokenizer value names; None if it cannot be
    one (it is then a local path that does not exist)."""
    if name.startswith((".", "/", "~")) or "\\" in name or "//" in name:
        return None
    repo, _, quant = name.partition(":")
    if quant and not re.fullmatch(r"[\w.-]+", quant):
        return None
    parts = repo.split("/")
    if len(parts) > 2 and parts[-1].endswith(".gguf") and not quant:
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        repo_id, filename = repo, None
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith(".gguf"):
        return None
    return HubName(repo_id, quant or None, filename)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (read now, not when huggingface_hub was imported)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return value.strip().lower() in _TRUE if value is not None else bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where hub files live: --download-dir, else HF_HUB_CACHE, else HF_HOME/hub (read now)."""
    from huggingface_hub import constants

    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def resolve_path(name: str, *, revision: str | None = None, download_dir: str | None = None,
                 what: str = "model", flag: str = "--model") -> Path:
    """A local path for `name`: the path itself if it exists, else the hub snapshot (or GGUF
    file) it names, from the cache or, when online, downloaded into it."""
    local = Path(name).expanduser()
    if local.exists():
        return local
    hub = parse_hub_name(name)
    if hub is None:
        raise FileNotFoundError(f"{what} {name!r}: no such file or directory, and not a Hugging "
                                f"Face hub id (org/name); pass a local path or a hub id with "
                                f"{flag}")
    cache = hub_cache_dir(download_dir)
    found = _from_cache(hub, revision, cache, what)
    if found is not None:
        return found
    where = f"{hub.repo_id}" + (f"@{revision}" if revision else "")
    if hub_offline():
        raise FileNotFoundError(
            f"{what} {name!r} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
            f"set, so it cannot be downloaded; download {where} first (`hf download "
            f"{hub.repo_id}`), point HF_HUB_CACHE / --download-dir at a cache holding it, or "
            f"pass a local path with {flag}")
    return _download(hub, revision, cache, what, name)


def _patterns(what: str) -> list[str]:
    return _TOKENIZER_PATTERNS if what == "tokenizer" else _MODEL_PATTERNS


def _snapshot(hub: HubName, revision: str | None, cache: Path, what: str, *,
              local_only: bool) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = _patterns(what) if hub.quant is None and hub.filename is None else ["*.json"]
    try:
        return Path(snapshot_download(hub.repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=local_only, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        return None


def _from_cache(hub: HubName, revision: str | None, cache: Path, what: str) -> Path | None:
    snapshot = _snapshot(hub, revision, cache, what, local_only=True)
    if snapshot is None or not snapshot.is_dir():
        return None
    if hub.quant is None and hub.filename is None:
        wanted = "tokenizer_config.json" if what == "tokenizer" else "config.json"
        usable = (snapshot / wanted).is_file() or (what == "model"
                                                   and len(list(snapshot.glob("*.gguf"))) == 1)
        return snapshot if usable else None
    files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")]
    try:
        return snapshot / pick_gguf_file(hub, files)
    except FileNotFoundError:
        return None  # maybe on the hub, not yet downloaded


def pick_gguf_file(hub: HubName, files: list[str]) -> str:
    """The one GGUF file of `files` (paths in the repo) that `hub` names: its path, or the file
    whose name ends in the quant type ("Qwen3-0.6B-Q4_K_M.gguf" for "Q4_K_M", any case)."""
    if hub.filename is not None:
        if hub.filename in files:
            return hub.filename
        raise FileNotFoundError(f"{hub.repo_id} has no file {hub.filename!r}")
    quant = hub.quant.lower()
    matches = sorted(f for f in files if fnmatch.fnmatch(Path(f).name.lower(), f"*{quant}.gguf"))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        raise FileNotFoundError(f"{hub.repo_id} has no GGUF file of quant type {hub.quant!r}"
                                + (f"; it has {', '.join(ggufs)}" if ggufs else ""))
    raise FileNotFoundError(f"{hub.repo_id}:{hub.quant} matches {len(matches)} files "
                            f"({', '.join(matches)}); Kiln loads single-file GGUF models: name "
                            "the file as org/repo/FILE.gguf")


def _download(hub: HubName, revision: str | None, cache: Path, what: str, name: str) -> Path:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if hub.quant is None and hub.filename is None:
            snapshot = _snapshot(hub, revision, cache, what, local_only=False)
            if snapshot is None:  # huggingface_hub says so when the hub cannot be reached
                raise FileNotFoundError(f"{what} {name!r} is not in the Hugging Face cache "
                                        f"({cache}) and the hub could not be reached; check "
                                        "the network, or set HF_HUB_OFFLINE=1 with a cache "
                                        "that holds it")
            if what == "model" and not (snapshot / "config.json").is_file():
                files = HfApi().list_repo_files(hub.repo_id, revision=revision)
                ggufs = [f for f in files if f.endswith(".gguf")]
                if len(ggufs) != 1:
                    raise FileNotFoundError(
                        f"model {name!r} has no config.json"
                        + (f" but GGUF files ({', '.join(sorted(ggufs))}); name one as "
                           f"{hub.repo_id}:QUANT" if ggufs else ""))
                hub = HubName(hub.repo_id, filename=ggufs[0])
            else:
                return snapshot
        files = HfApi().list_repo_files(hub.repo_id, revision=revision)
        filename = pick_gguf_file(hub, files)
        _snapshot(hub, revision, cache, what, local_only=False)  # config.json, if the repo has one
        return Path(hf_hub_download(hub.repo_id, filename, revision=revision, cache_dir=cache))
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"{what} {name!r}: the Hugging Face hub refused it ({e}); check "
                                "the id, --revision and your access (HF_TOKEN)") from None
