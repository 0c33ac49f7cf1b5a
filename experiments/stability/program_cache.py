"""The lab's compiled programs and sampled task pools kept on disk, keyed by everything that
decides them, so that a warm run loads them without tracing anything.

JAX's persistent compilation cache is keyed by the lowered program, so even a warm run traces
and lowers every program to find its key (~2 s of the `cpu` group's 18 s). This cache is keyed
instead by what a program is a function of:

  - the code: the bytes of every .py file of `flax_blocks` and `experiments` (subpackages
    included), and the versions of Python, jax, jaxlib, flax, optax and numpy;
  - how it is compiled: XLA_FLAGS, every JAX configuration value (the cache's own settings
    excepted), the compile options, the platform, the host CPU's instruction-set extensions,
    the process count and the devices it runs on;
  - the program's own description, given by its caller (for a Trainer: the program's name, the
    model, training and task configs, the run count and the shapes of the data it takes).

Any change to any of these is another key, so an entry is never used for another program
(tests/test_program_cache.py changes each alone, and compiles for two simulated devices); an
entry that cannot be read is recomputed (and overwritten). Entries are written whole (a
temporary file renamed), so an interrupted run leaves none half-written; past `MAX_BYTES`
(1 GiB) the least recently used go, since every edit of the code makes new keys. Programs are stored
with `jax.experimental.serialize_executable` (loading one runs code from this folder: it is a
cache of this user's own runs, never a download). One process only: several processes trace in
lockstep for their collectives, so the lab bypasses this cache there.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import pickle
import platform
import tempfile
import warnings
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

PACKAGES = ("flax_blocks", "experiments")  # whose source decides the programs
VERSIONS = ("jax", "jaxlib", "flax", "optax", "numpy")
# JAX settings that only say where and how programs are cached or logged, not what they compute
CONFIG_IGNORED = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                  "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
                  "jax_persistent_cache_enable_xla_caches", "jax_raise_persistent_cache_errors",
                  "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules", "jax_log_compiles")


@cache
def code_digest() -> str:
    """sha256 of the source of PACKAGES (every .py file's path and bytes) and the versions of
    Python and VERSIONS; computed once per process."""
    h = hashlib.sha256(f"python {platform.python_version()}".encode())
    for name in VERSIONS:
        h.update(f"\n{name} {importlib.metadata.version(name)}".encode())
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {package} not found")
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            h.update(f"\n{package}/{path.relative_to(root).as_posix()}\n".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@cache
def host_cpu() -> str:
    """The host's architecture and instruction-set extensions (XLA:CPU compiles for them, so a
    cache folder shared between machines must not hand one's programs to another)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} " + " ".join(sorted(flags.split()))


def environment_key() -> dict[str, Any]:
    """How this process compiles: XLA_FLAGS, JAX's configuration, the platform and its version,
    the host CPU, the process count."""
    config = {k: v for k, v in sorted(jax.config.values.items()) if k not in CONFIG_IGNORED}
    device = jax.devices()[0]
    return {"code": code_digest(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "config": config,
            "platform": [jax.default_backend(), device.client.platform_version, device.device_kind],
            "host": host_cpu(), "process_count": jax.process_count()}


def jax_cache_on() -> bool:
    """Whether JAX's persistent compilation cache is on in this process. An executable JAX
    loaded from it cannot be serialized again (XLA:CPU, jaxlib 0.10.2, writes it without its
    compiled functions: the next process fails with "Function ... not found"), so programs
    compiled while it is on are not stored here."""
    return bool(jax.config.values["jax_enable_compilation_cache"] and jax.config.values["jax_compilation_cache_dir"])


MAX_BYTES = 1 << 30  # the folder's size past which the least recently used entries go (1 GiB)


class ProgramCache:
    """Compiled programs (`program`) and sampled arrays (`array`) under `folder`, keyed by a
    description of what they compute together with `environment_key()`. `loaded` and `made`
    count, per kind, the entries found and the ones computed (and stored)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int = MAX_BYTES):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.loaded = {"program": 0, "array": 0}
        self.made = {"program": 0, "array": 0}
        self.writable = True  # False after a write failed (warned once; the run goes on uncached)

    def key(self, kind: str, description: dict[str, Any]) -> str:
        """The entry's file stem: kind, then the sha256 of the description and the environment."""
        text = json.dumps({"kind": kind, "what": description, "environment": environment_key()},
                          sort_keys=True, default=repr)
        return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def program(self, description: dict[str, Any], devices: Iterable[jax.Device],
                compile_fn: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The compiled program for `description` on `devices`: loaded when an entry exists,
        else `compile_fn()` (which traces, lowers and compiles it) and stored."""
        devices = list(devices)
        key = self.key("program", {**description, "devices": [d.id for d in devices]})
        path = self.folder / f"{key}.pkl"
        blob = self._read(path)
        if blob is not None:
            try:
                serialized, in_tree, out_tree = pickle.loads(blob)
                loaded = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                   execution_devices=devices)
            except Exception:  # an entry from a build that cannot load it: compile again
                loaded = None
            if loaded is not None:
                self.loaded["program"] += 1
                return loaded
        self.made["program"] += 1
        compiled = compile_fn()
        if not jax_cache_on():  # else it may be JAX's cached copy, which cannot be serialized again
            self._write(path, pickle.dumps(serialize_executable.serialize(compiled)))
        return compiled

    def array(self, description: dict[str, Any], make: Callable[[], np.ndarray]) -> np.ndarray:
        """The array `make()` returns for `description` (a deterministic sample), loaded when
        an entry exists, else made and stored."""
        path = self.folder / f"{self.key('array', description)}.npy"
        blob = self._read(path)
        if blob is not None:
            try:
                out = np.load(io.BytesIO(blob), allow_pickle=False)
                self.loaded["array"] += 1
                return out
            except ValueError:  # not an array file: make it again
                pass
        self.made["array"] += 1
        out = np.asarray(make())
        buffer = io.BytesIO()
        np.save(buffer, out, allow_pickle=False)
        self._write(path, buffer.getvalue())
        return out

    @staticmethod
    def _read(path: Path) -> bytes | None:
        """The entry's bytes (its time touched: `_trim` drops the least recently used), or None."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):  # a folder others share read-only still serves
            os.utime(path)
        return data

    def _trim(self, keep: Path) -> None:
        """Keys follow every edit of the code, so old entries pile up: past `max_bytes`, drop the
        least recently used entries (never `keep`, the one just written) down to three quarters
        of it. Another process reading a dropped entry compiles it again."""
        entries = []
        for path in self.folder.glob("*-*.*"):
            try:
                st = path.stat()
            except OSError:  # dropped by another process meanwhile
                continue
            if path.suffix in (".pkl", ".npy"):
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * 3 // 4:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size

    def _write(self, path: Path, data: bytes) -> None:
        """Write whole or not at all (a temporary file in the folder, renamed). A folder that
        cannot be written is one warning, as for JAX's own cache: the run goes on uncached."""
        if not self.writable:
            return
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{path.stem}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self._trim(keep=path)
        except OSError as err:
            self.writable = False
            warnings.warn(f"program cache: could not write in {self.folder} ({err}); running without it",
                          stacklevel=3)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
