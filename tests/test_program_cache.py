"""The lab's program cache (experiments/stability/program_cache.py): what it stores it loads without
compiling, any change of what it is keyed by is another entry, a bad entry is compiled again.
That loaded programs give the same cells bit for bit is checked end to end by
tests/test_experiments.py (the killed sweep's rerun)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import xla_flags  # the suite's XLA flags, the device count replaced

from experiments.stability import program_cache
from experiments.stability.model import ModelConfig
from experiments.stability.program_cache import ProgramCache
from experiments.stability.tasks import make_task
from experiments.stability.train import RunSpec, TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]

X = jnp.arange(6.0)


def _compile(scale: float = 3.0):
    return lambda: jax.jit(lambda x: jnp.sin(x) * scale).lower(X).compile()


def _never():
    raise AssertionError("compiled, though the cache held the program")


def test_a_stored_program_is_loaded_without_compiling(tmp_path):
    devices = jax.devices()[:1]
    first = ProgramCache(tmp_path)
    want = np.asarray(first.program({"f": "sin"}, devices, _compile())(X))
    assert first.made == {"program": 1, "array": 0}
    again = ProgramCache(tmp_path)  # another process's view of the same folder
    got = again.program({"f": "sin"}, devices, _never)
    np.testing.assert_array_equal(np.asarray(got(X)), want)
    assert again.loaded == {"program": 1, "array": 0} and again.made["program"] == 0
    # another description is another program: compiled, not the stored one
    other = again.program({"f": "sin", "scale": 4}, devices, _compile(4.0))
    np.testing.assert_allclose(np.asarray(other(X)), np.sin(np.arange(6.0)) * 4, rtol=1e-6)
    assert again.made["program"] == 1
    assert not list(tmp_path.glob(".*.tmp"))  # written whole: no temporary file left


def test_a_corrupt_entry_is_compiled_again(tmp_path):
    devices = jax.devices()[:1]
    ProgramCache(tmp_path).program({"f": "sin"}, devices, _compile())
    (entry,) = tmp_path.glob("program-*.pkl")
    entry.write_bytes(b"not a program")
    cache = ProgramCache(tmp_path)
    got = cache.program({"f": "sin"}, devices, _compile())
    np.testing.assert_allclose(np.asarray(got(X)), np.sin(np.arange(6.0)) * 3, rtol=1e-6)
    assert cache.made["program"] == 1 and cache.loaded["program"] == 0
    assert ProgramCache(tmp_path).program({"f": "sin"}, devices, _never) is not None  # rewritten whole


def test_arrays_are_stored_and_loaded(tmp_path):
    made = np.arange(12, dtype=np.int32).reshape(3, 4)
    cache = ProgramCache(tmp_path)
    np.testing.assert_array_equal(cache.array({"pool": 1}, lambda: made), made)
    got = ProgramCache(tmp_path).array({"pool": 1}, _never)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, made)
    assert ProgramCache(tmp_path).array({"pool": 2}, lambda: made + 1)[0, 0] == 1  # another key


# What the key covers, one item of the module's docstring each: a change of the item alone
# changes the key (each fails when its item is left out of the key).
ONE_FILE = {"flax_blocks": ROOT / "flax_blocks" / "core" / "config.py",  # in a subpackage: every
            "experiments": ROOT / "experiments" / "stability" / "train.py"}  # folder is read


def _a_files_bytes(package: str):
    def change(monkeypatch):
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes",
                            lambda self: real(self) + (b"#" if self.resolve() == ONE_FILE[package] else b""))
    return change


def _a_version(name: str):
    def change(monkeypatch):
        if name == "python":
            monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
        else:
            real = importlib.metadata.version
            monkeypatch.setattr(importlib.metadata, "version", lambda n: real(n) + ("-other" if n == name else ""))
    return change


def _another_device(**changed):
    def change(monkeypatch):
        real = jax.devices()[0]
        version = changed.get("version", real.client.platform_version)
        fake = SimpleNamespace(client=SimpleNamespace(platform_version=version),
                               device_kind=changed.get("kind", real.device_kind))
        monkeypatch.setattr(jax, "devices", lambda *a: [fake])
    return change


KEY_ITEMS = {
    "code: flax_blocks": _a_files_bytes("flax_blocks"),
    "code: experiments": _a_files_bytes("experiments"),
    **{f"version: {n}": _a_version(n) for n in ("python", "jax", "jaxlib", "flax", "optax", "numpy")},
    "XLA_FLAGS": lambda mp: mp.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true"),
    "JAX config": lambda mp: jax.default_matmul_precision("highest"),  # a context, entered by the test
    "platform": lambda mp: mp.setattr(jax, "default_backend", lambda: "gpu"),
    "platform version": _another_device(version="another build"),
    "device kind": _another_device(kind="another chip"),
    "host CPU": lambda mp: mp.setattr(program_cache, "host_cpu", lambda: "x86_64 avx2"),  # a shared folder
    "process count": lambda mp: mp.setattr(jax, "process_count", lambda: 2),
}


@pytest.mark.parametrize("item", KEY_ITEMS)
def test_each_thing_the_key_covers_changes_it(item, tmp_path, monkeypatch):
    cache = ProgramCache(tmp_path)
    program_cache.code_digest.cache_clear()
    try:
        key = cache.key("program", {"f": "sin"})
        assert cache.key("program", {"f": "sin"}) == key  # stable
        with monkeypatch.context() as m, contextlib.ExitStack() as stack:
            context = KEY_ITEMS[item](m)
            if context is not None:
                stack.enter_context(context)
            program_cache.code_digest.cache_clear()
            assert cache.key("program", {"f": "sin"}) != key, item
        program_cache.code_digest.cache_clear()
        assert cache.key("program", {"f": "sin"}) == key  # and back
    finally:
        program_cache.code_digest.cache_clear()


def test_the_caches_own_settings_are_no_part_of_the_key(tmp_path):
    cache = ProgramCache(tmp_path)
    key = cache.key("program", {"f": "sin"})
    before = {k: jax.config.values[k] for k in ("jax_compilation_cache_dir", "jax_log_compiles")}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_log_compiles", True)
        assert cache.key("program", {"f": "sin"}) == key
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


def test_the_host_cpu_is_its_instruction_set(monkeypatch):
    def cpuinfo(flags):
        return lambda *a, **k: io.StringIO(f"processor\t: 0\nflags\t\t: {flags}\n")

    monkeypatch.setattr(program_cache, "open", cpuinfo("fpu sse2 avx2"), raising=False)
    avx2 = program_cache.host_cpu.__wrapped__()
    assert avx2.endswith("avx2 fpu sse2")
    monkeypatch.setattr(program_cache, "open", cpuinfo("fpu sse2 avx2 avx512f"), raising=False)
    assert program_cache.host_cpu.__wrapped__() != avx2


DEVICE_SETS = """
import json, sys
import jax, jax.numpy as jnp
from experiments.stability.program_cache import ProgramCache

d0, d1 = jax.devices()
folder, made = sys.argv[1], []

def compile_on(d):
    def compile_fn():
        made.append(d.id)
        return jax.jit(lambda x: jnp.sin(x) * 3).lower(jax.device_put(jnp.arange(6.0), d)).compile()
    return compile_fn

def never():
    raise AssertionError("compiled, though the cache held the program")

ProgramCache(folder).program({"f": "sin"}, [d0], compile_on(d0))
on_d1 = ProgramCache(folder).program({"f": "sin"}, [d1], compile_on(d1))  # another process's view
out = on_d1(jax.device_put(jnp.arange(6.0), d1))
ProgramCache(folder).program({"f": "sin"}, [d0], never)  # each device set finds its own
print(json.dumps({"made": made, "devices": [d.id for d in out.devices()]}))
"""


def test_a_program_for_one_device_is_never_served_for_another(tmp_path):
    """Two simulated CPU devices: the program compiled for device 0 is not the one device 1
    gets; each is stored under its own key and found again."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    proc = subprocess.run([sys.executable, "-c", DEVICE_SETS, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"made": [0, 1], "devices": [1]}
    assert len(list(tmp_path.glob("program-*.pkl"))) == 2


def _trainer(**kw) -> Trainer:
    task = make_task("markov", vocab=16, seq_len=8, seed=kw.pop("task_seed", 0))
    cfg = ModelConfig(kw.pop("variant", "pre"), 2, vocab=16, seq_len=8, d_model=16, num_heads=2, d_ff=32)
    return Trainer(cfg, task, TrainConfig(steps=4, batch=kw.pop("batch", 4), chunk=2, heldout=4, pool=64), **kw)


def test_a_trainers_programs_are_described_by_everything_they_compute_from():
    runs = [RunSpec(1e-3, 0, 0), RunSpec(1e-2, 2, 1)]
    a = _trainer().describe(runs, "chunk")
    assert a == _trainer().describe([RunSpec(3e-3, 5, 7), RunSpec(1e-1, 0, 2)], "chunk")  # runtime values
    assert a != _trainer().describe(runs, "probe")
    assert a != _trainer(variant="post").describe(runs, "chunk")  # the model
    assert a != _trainer(batch=8).describe(runs, "chunk")  # the training config (and so the data's shapes)
    assert a != _trainer(task_seed=1).describe(runs, "chunk")  # the task
    assert a != _trainer().describe(runs[:1], "chunk")  # another run count
    assert a != _trainer(options={"xla_backend_optimization_level": 0}).describe(runs, "chunk")
    with pytest.raises(ValueError, match="program must be one of"):
        _trainer().describe(runs, "train")


def test_task_data_of_the_wrong_shape_is_refused_by_name():
    tr = _trainer()
    pool, heldout = np.zeros((64, 9), np.int32), np.zeros((4, 9), np.int32)
    tr.use_data(pool + 1, heldout)
    with pytest.raises(ValueError, match=r"pool must be integer tokens of shape \(64, 9\).*got int32 \(64, 8\)"):
        tr.use_data(pool[:, :8], heldout)
    with pytest.raises(ValueError, match=r"heldout must be integer tokens of shape \(4, 9\).*got float32"):
        tr.use_data(pool, heldout.astype(np.float32))
    assert int(tr.pool[0, 0]) == 1  # a refused call changed nothing
    with pytest.raises(ValueError, match="give both pool and heldout"):
        _trainer(pool=pool)


def test_one_process_uses_the_program_cache_and_not_jaxs(tmp_path, monkeypatch):
    """An executable JAX loaded from its own cache cannot be serialized again (XLA:CPU writes it
    without its compiled functions), so the lab never has both caches on."""
    from experiments.stability.sweep import compile_cache

    before = {k: jax.config.values[k] for k in ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    try:
        assert compile_cache() == str(tmp_path)
        assert not jax.config.values["jax_enable_compilation_cache"]
        assert jax.config.values["jax_compilation_cache_dir"] is None
        assert compile_cache(jax_cache=True) == str(tmp_path)  # several processes: JAX's, in the same folder
        assert jax.config.values["jax_enable_compilation_cache"]
        assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path)
        assert compile_cache(enabled=False) is None
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


def test_the_programs_trees_name_no_flax_class_and_bind_each_array_at_its_path(tmp_path):
    """The lab's programs take and return a model's states as nested dicts, so a warm run loads
    them without importing Flax; the model bound from such dicts is the model they came from."""
    import pickle

    from flax import nnx

    from experiments.stability.model import create_params, model_binder, pure_params

    tr = _trainer(program_cache=ProgramCache(tmp_path))
    runs = [RunSpec(1e-3, 0, 0), RunSpec(1e-2, 2, 1)]
    for program in ("init", "probe"):
        compiled = tr.compile(runs, program)
        assert b"flax" not in pickle.dumps((compiled.in_tree, compiled.out_tree)), program
    cfg, key = tr.model_cfg, jax.random.key(3)
    params, rest = pure_params(cfg, key)
    bound = nnx.state(model_binder(cfg)(params, rest), nnx.Param)
    _, want, _ = create_params(cfg, key)
    for (path, got), (want_path, value) in zip(nnx.to_flat_state(bound), nnx.to_flat_state(want), strict=True):
        assert path == want_path
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(value.get_value()), err_msg=str(path))


def test_a_folder_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cache = ProgramCache(blocker / "programs")  # below a file: no folder can be made there
    devices = jax.devices()[:1]
    with pytest.warns(UserWarning, match="could not write in .*a_file/programs") as warned:
        got = cache.program({"f": "sin"}, devices, _compile())
        cache.array({"pool": 1}, lambda: np.zeros(3, np.int32))
    assert len(warned) == 1
    np.testing.assert_allclose(np.asarray(got(X)), np.sin(np.arange(6.0)) * 3, rtol=1e-6)


def test_nothing_is_stored_while_jaxs_own_cache_is_on(tmp_path, monkeypatch):
    """Its executables may be JAX's cached copies, which XLA:CPU cannot serialize again."""
    before = {k: jax.config.values[k] for k in ("jax_enable_compilation_cache", "jax_compilation_cache_dir")}
    try:  # the switch read from JAX's config (nothing compiled meanwhile: JAX sets its cache up on a compile)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        assert program_cache.jax_cache_on()
        jax.config.update("jax_enable_compilation_cache", False)
        assert not program_cache.jax_cache_on()
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
    monkeypatch.setattr(program_cache, "jax_cache_on", lambda: True)
    cache = ProgramCache(tmp_path / "programs")
    cache.program({"f": "sin"}, jax.devices()[:1], _compile())
    assert cache.made["program"] == 1 and not list((tmp_path / "programs").glob("program-*"))


def test_past_its_size_the_least_recently_used_entries_go(tmp_path):
    import os
    import time

    cache = ProgramCache(tmp_path, max_bytes=4000)
    name = {i: f"{cache.key('array', {'pool': i})}.npy" for i in range(4)}
    for i in range(3):  # three entries of 1128 bytes, written long ago, one after another
        cache.array({"pool": i}, lambda: np.zeros(250, np.int32))
        os.utime(tmp_path / name[i], (time.time() - 100 + i,) * 2)
    cache.array({"pool": 0}, _never)  # read: now the most recently used
    cache.array({"pool": 3}, lambda: np.zeros(250, np.int32))  # 4512 bytes > 4000: down to 3000
    assert {p.name for p in tmp_path.glob("*.npy")} == {name[0], name[3]}
