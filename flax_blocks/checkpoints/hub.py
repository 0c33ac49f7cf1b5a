"""A Hugging Face Hub id or a local folder, resolved to a local folder.

`resolve("org/name")` returns the snapshot folder of that model in huggingface_hub's cache,
downloading config.json and the weights (safetensors, else the older pytorch_model*.bin) when
online; an existing folder is returned as is. HF_HUB_OFFLINE and HF_HUB_CACHE are read when
`resolve` is called, not when huggingface_hub is imported. Every failure is one exception with a
one-line message naming the id, the revision, the cache searched and what to do.

No framework is imported; huggingface_hub (the `hf` extra) only when an id is resolved.
"""

from __future__ import annotations

import glob
import os
import re
import sys

_ID = re.compile(r"^[\w-][\w.-]*(/[\w-][\w.-]*)?$")  # "org/name" or "name"; no leading ".", no other "/"
_TRUE = {"1", "true", "yes", "on"}
SAFETENSORS = ["config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json"]
PYTORCH_BIN = ["config.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]


def is_hub_id(source: str) -> bool:
    """True if `source` looks like a Hub repo id ("org/name" or "name")."""
    return bool(_ID.match(source)) and ".." not in source


def _has(folder: str, pattern: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(folder), pattern)))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def resolve(source: str, revision: str | None = None) -> str:
    """A local folder for `source`: the folder itself when it exists; else, when `source` looks like a Hub id
    ("org/name" or "name"), the snapshot folder of that model in huggingface_hub's cache, downloading config.json
    and the weights when online.

    Raises ValueError for a revision given with a local folder, ImportError when huggingface_hub is missing, and
    FileNotFoundError (one line) for anything that cannot be found: no such folder, an id not cached while
    HF_HUB_OFFLINE is set, an id unknown to the Hub, gated, a revision that does not exist, no network."""
    source = os.fspath(source)
    if os.path.isdir(source):
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given for the local folder {source!r}; "
                             "a revision only applies to a Hub id: drop it, or check out that revision into the folder")
        return source
    if os.path.exists(source):
        raise NotADirectoryError(f"{source!r} is a file, not a folder: pass the folder that holds it")
    if not is_hub_id(source):
        raise FileNotFoundError(f"{source!r}: no such folder (nor a Hub id like 'org/name')")
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        msg = f"reading the Hub id {source!r} needs huggingface_hub: pip install 'twin-blocks[hf]'"
        raise ImportError(msg) from None

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    cache_dir = os.path.expanduser(os.environ["HF_HUB_CACHE"]) if os.environ.get("HF_HUB_CACHE") else None
    cache = cache_dir or constants.HF_HUB_CACHE
    what = f"Hub id {source!r}" + (f" at revision {revision!r}" if revision is not None else "")
    # Connection errors of whichever HTTP client this huggingface_hub uses (httpx2, httpx or requests).
    net = tuple(getattr(sys.modules[m], n) for m, n in
                (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")) if m in sys.modules)
    known = tuple(getattr(errors, n) for n in ("HfHubHTTPError", "LocalEntryNotFoundError", "HFValidationError",
                                              "OfflineModeIsEnabled") if hasattr(errors, n))

    def message(e: BaseException) -> str:
        def isa(name: str) -> bool:
            return isinstance(e, getattr(errors, name, ()))

        if isa("HFValidationError"):
            return f"{source!r}: no such folder, and not a valid Hub id ({_first_line(e)})"
        if isa("GatedRepoError"):
            return (f"{what} is gated and not in the Hugging Face cache {cache}: accept its terms on "
                    f"https://huggingface.co/{source} and log in (`hf auth login`), or pass a local folder")
        if isa("RepositoryNotFoundError"):
            return (f"{what} was not found on the Hub nor in the Hugging Face cache {cache} (a private repository "
                    "needs `hf auth login`): check the id, or pass a local folder")
        if isa("RevisionNotFoundError"):
            return f"{what}: the Hub has no such revision (cache {cache}): check the branch, tag or commit hash"
        if isa("IncompleteSnapshotError"):
            return (f"{what} is only partly in the Hugging Face cache {cache} ({_first_line(e)}): "
                    "download it again online, or pass a local folder")
        blocked = isinstance(e.__cause__ or e, getattr(errors, "OfflineModeIsEnabled", ()))
        if offline or blocked:
            flag = "is set" if offline else "was set when huggingface_hub was imported"
            cmd = f"hf download {source}" + (f" --revision {revision}" if revision is not None else "")
            return (f"{what} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE {flag}: download it once "
                    f"online (unset HF_HUB_OFFLINE, then `{cmd}`) or pass a local folder")
        return (f"{what} is not in the Hugging Face cache {cache} and could not be downloaded "
                f"({_first_line(e.__cause__ or e)}): check the id and your network, or pass a local folder")

    def fetch(patterns: list[str]) -> str:
        try:
            return snapshot_download(source, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                     allow_patterns=patterns)
        except known + net as e:
            raise FileNotFoundError(message(e)) from None

    folder = fetch(SAFETENSORS)
    if not _has(folder, "*.safetensors"):
        folder = fetch(PYTORCH_BIN)  # older repositories hold only pytorch_model.bin
        if not _has(folder, "pytorch_model*.bin"):
            raise FileNotFoundError(f"{what} holds no weights (*.safetensors or pytorch_model*.bin) in {folder}"
                                    + (" (HF_HUB_OFFLINE is set: download them once online)" if offline else ""))
    return folder
