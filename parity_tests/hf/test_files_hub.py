"""flax_blocks.checkpoints.hub.resolve: a local folder is returned as is; a Hub id resolves to its snapshot
folder in a fake huggingface_hub cache (laid out as the library lays it out); each failure is one
single-line exception naming what to do.

No network: every test sets HF_HUB_OFFLINE=1 and HF_HUB_CACHE to a temporary folder (after
huggingface_hub was imported, so the flags are read at call time); the few that check the online
error messages replace snapshot_download with a stub that raises."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub  # noqa: E402
from huggingface_hub import errors  # noqa: E402

from flax_blocks.checkpoints.hub import resolve  # noqa: E402

HASH = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache; HF_HUB_OFFLINE=1 and HF_HUB_CACHE set after huggingface_hub's import."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def snapshot(cache, repo_id, files=("config.json", "model.safetensors"), commit=HASH, ref="main"):
    """Lay out `repo_id` as huggingface_hub does: refs/<ref> holds the commit, snapshots/<commit>/ the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as the library writes it
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("{}")
    return str(folder)


def test_cached_id_resolves_to_its_snapshot(cache):
    folder = snapshot(cache, "org/name")
    got = resolve("org/name")
    assert os.path.samefile(got, folder)
    assert os.path.isfile(os.path.join(got, "config.json"))


def test_single_name_id_resolves(cache):
    folder = snapshot(cache, "gpt2")
    assert os.path.samefile(resolve("gpt2"), folder)


def test_revision_commit_hash_resolves(cache):
    snapshot(cache, "org/name")
    older = snapshot(cache, "org/name", commit=OTHER, ref=None)  # in snapshots/, not the ref main points to
    assert os.path.samefile(resolve("org/name", revision=OTHER), older)
    assert not os.path.samefile(resolve("org/name"), older)


def test_bin_only_snapshot_found_by_the_second_patterns(cache):
    folder = snapshot(cache, "org/old", files=("config.json", "pytorch_model.bin"))
    got = resolve("org/old")
    assert os.path.samefile(got, folder)
    assert os.path.isfile(os.path.join(got, "pytorch_model.bin"))


def test_snapshot_without_weights_is_one_error(cache):
    snapshot(cache, "org/bare", files=("config.json",))
    with pytest.raises(FileNotFoundError, match="holds no weights") as e:
        resolve("org/bare")
    assert "'org/bare'" in str(e.value) and "\n" not in str(e.value)


def test_missing_id_offline_is_one_line_error(cache):
    with pytest.raises(FileNotFoundError) as e:
        resolve("org/missing", revision="v1")
    msg = str(e.value)
    assert "'org/missing'" in msg and "'v1'" in msg and str(cache) in msg
    assert "HF_HUB_OFFLINE is set" in msg and "pass a local folder" in msg
    assert "\n" not in msg
    assert e.value.__suppress_context__ and e.value.__cause__ is None  # one exception, no chain shown


def test_offline_flag_read_at_call_time(cache, monkeypatch):
    seen = {}

    def fake(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        folder = cache / "x"
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors").write_text("")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    resolve("org/name")
    assert seen["local_files_only"] is True and seen["cache_dir"] == str(cache) and seen["repo_id"] == "org/name"
    assert "*.safetensors" in seen["allow_patterns"] and "config.json" in seen["allow_patterns"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    resolve("org/name")
    assert seen["local_files_only"] is False
    monkeypatch.setenv("HF_HUB_OFFLINE", "TRUE")
    resolve("org/name")
    assert seen["local_files_only"] is True


def test_existing_folder_is_returned_as_is(cache, tmp_path):
    folder = str(tmp_path / "model")
    os.mkdir(folder)
    assert resolve(folder) == folder
    with pytest.raises(ValueError, match="revision='main'.*local folder"):
        resolve(folder, revision="main")


def test_id_like_existing_folder_wins_over_the_hub(cache, tmp_path, monkeypatch):
    snapshot(cache, "org/name")
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/name")
    assert resolve("org/name") == "org/name"


@pytest.mark.parametrize("path", ["./nope", "/tmp/definitely-missing-twin-blocks", "../up/there", "a/b/c", ".hidden"])
def test_missing_path_names_it(cache, tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder") as e:
        resolve(path)
    assert repr(path) in str(e.value)


def test_a_file_is_not_a_folder(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(NotADirectoryError, match="'model.safetensors' is a file"):
        resolve("model.safetensors")


def test_missing_huggingface_hub_names_the_extra(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match=r"'x/y' needs huggingface_hub: pip install 'twin-blocks\[hf\]'"):
        resolve("x/y")


def _http_error(cls, status):
    httpx = pytest.importorskip("httpx2")
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/name"))
    return cls(f"{status} Client Error.\n\nRepository Not Found for url: ...", response=response)


@pytest.mark.parametrize("make, expected", [
    (lambda: _http_error(errors.RepositoryNotFoundError, 404), "was not found on the Hub"),
    (lambda: _http_error(errors.GatedRepoError, 403), "is gated"),
    (lambda: _http_error(errors.RevisionNotFoundError, 404), "no such revision"),
])
def test_online_hub_errors_are_one_line(cache, monkeypatch, make, expected):
    def fake(repo_id, **kw):
        raise make()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(FileNotFoundError, match=expected) as e:
        resolve("org/name", revision="dev")
    msg = str(e.value)
    assert "'org/name'" in msg and "'dev'" in msg and str(cache) in msg and "\n" not in msg


def test_no_network_is_one_line(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # safe: snapshot_download is the stub below

    def fake(repo_id, **kw):
        assert kw["local_files_only"] is False
        try:
            raise ConnectionError("[Errno -3] Temporary failure in name resolution")
        except ConnectionError as cause:
            raise errors.LocalEntryNotFoundError("An error happened ...\nPlease check your connection") from cause

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(FileNotFoundError, match="could not be downloaded .ConnectionError: .Errno -3. Temp") as e:
        resolve("org/name")
    assert "\n" not in str(e.value)
