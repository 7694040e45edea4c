"""The disk cache of translated groups."""

import json
import os

import pytest
import torch

import lort
from lort.backend import LortBackend
from lort.capture import decompositions
from lort.fusion import support
from lort.compile import disk_cache
from lort.compile.disk_cache import DiskCache
from lort.testing.models import MLP
from lort.translate import _compat, onnx_export, registry


def run(cache_dir, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(4, 64, requires_grad=True)
    backend = LortBackend({"disk_cache": True, "cache_dir": str(cache_dir), **options})
    out = torch.compile(m, backend=backend)(x)
    out.pow(2).sum().backward()
    return backend, out.detach(), x.grad


def group_modules(backend):
    return [mod for r in backend.records for mod in r.group_modules.values()]


def test_second_compile_reads_the_cache_and_skips_translation(tmp_path, monkeypatch):
    cold, out_cold, grad_cold = run(tmp_path)
    assert not any(m.from_cache for m in group_modules(cold))
    entries = sorted(os.listdir(tmp_path))
    assert len([e for e in entries if e.endswith(".onnx")]) == len(group_modules(cold)) == 2
    assert len([e for e in entries if e.endswith(".json") and not e.endswith(".rec.json")]) == 2
    # Records: the partition of each graph (forward, backward) and torch_lib's op list.
    assert len([e for e in entries if e.endswith(".rec.json")]) == 3

    def refuse(what):
        def fail(*a, **k):
            raise AssertionError(f"{what} although the disk cache holds the result")

        return fail

    # A warm compile neither translates, nor checks support, nor builds torch_lib's
    # registry (seconds of a cold start).
    monkeypatch.setattr(onnx_export, "translate_group", refuse("translated"))
    monkeypatch.setattr(support, "unsupported_reason", refuse("checked support"))
    monkeypatch.setattr(registry, "registry", refuse("built the registry"))
    monkeypatch.setattr(_compat, "torchlib_registry", refuse("built the registry"))
    decompositions.table.cache_clear()
    warm, out_warm, grad_warm = run(tmp_path)
    mods = group_modules(warm)
    assert mods and all(m.from_cache for m in mods)
    torch.testing.assert_close(out_warm, out_cold, rtol=0, atol=0)
    torch.testing.assert_close(grad_warm, grad_cold, rtol=0, atol=0)
    # The timed choices come back with the model.
    assert [m.threads for m in mods] == [m.threads for m in group_modules(cold)]
    assert [g.fusions for r in warm.records for g in r.groups] == [g.fusions for r in cold.records for g in r.groups]


def test_options_that_change_the_model_miss_the_cache(tmp_path):
    run(tmp_path)
    other, _, _ = run(tmp_path, ort_fusions=False)
    assert not any(m.from_cache for m in group_modules(other))


def test_damaged_entry_is_translated_again(tmp_path):
    run(tmp_path)
    for name in os.listdir(tmp_path):
        if name.endswith(".onnx"):
            with open(tmp_path / name, "wb") as f:
                f.write(b"truncated")
    again, out, _ = run(tmp_path)
    assert not any(m.from_cache for m in group_modules(again))
    torch.manual_seed(0)
    m = MLP()
    torch.testing.assert_close(out, m(torch.randn(4, 64)).detach(), rtol=1e-5, atol=1e-5)


def test_cache_off_writes_nothing(tmp_path):
    run(tmp_path, disk_cache=False)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


def test_least_recently_used_entries_go_over_the_size_limit(tmp_path):
    cache = DiskCache(str(tmp_path), max_bytes=3000)
    for i in range(5):
        cache.store(f"k{i}", bytes(1000), {"threads": 1})
        os.utime(tmp_path / f"k{i}.onnx", (i, i))
        os.utime(tmp_path / f"k{i}.json", (i, i))
    cache.store("k5", bytes(1000), {"threads": 1})
    total = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
    assert total <= 3000
    assert cache.load("k5") is not None
    assert cache.load("k0") is None
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    meta = json.loads((tmp_path / "k5.json").read_text())
    assert meta["size"] == 1000


def test_the_directory_is_listed_once_per_process_until_the_limit(tmp_path, monkeypatch):
    """Thousands of tiny models (ORTModule's einsum tests build one per case) must not
    list the cache directory at every write: once on the process's first write, then
    only when what it wrote passes the limit, which eviction takes down to 90% of it."""
    from lort.compile import disk_cache

    listed = []
    real_listdir = os.listdir
    monkeypatch.setattr(disk_cache.os, "listdir", lambda d: listed.append(d) or real_listdir(d))
    monkeypatch.setattr(disk_cache, "_known_bytes", {})
    (tmp_path / "old.rec.json").write_bytes(bytes(500))  # another process's entry
    os.utime(tmp_path / "old.rec.json", (0, 0))
    cache = DiskCache(str(tmp_path), max_bytes=20_000)
    for i in range(40):
        cache.store_record(f"r{i}", {"i": i})
    assert len(listed) == 1
    for i in range(30):  # ~1 KB each: past the limit, then evicted down to 90% of it
        cache.store(f"k{i}", bytes(1000), {"threads": 1})
    assert 2 <= len(listed) <= 5, len(listed)
    total = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
    assert total <= 20_000
    assert not (tmp_path / "old.rec.json").exists()  # the least recently used went first
    assert cache.load("k29") is not None


def test_env_turns_the_cache_off_and_moves_it(monkeypatch, tmp_path):
    monkeypatch.setenv("LORT_DISK_CACHE", "0")
    assert lort.Options().disk_cache is False
    monkeypatch.setenv("LORT_DISK_CACHE", "1")
    monkeypatch.setenv("LORT_CACHE_DIR", str(tmp_path / "here"))
    opts = lort.Options()
    assert opts.disk_cache is True and opts.cache_dir == str(tmp_path / "here")
    monkeypatch.setenv("LORT_DISK_CACHE", "maybe")
    with pytest.raises(ValueError, match="LORT_DISK_CACHE"):
        lort.Options()


def test_keys_ignore_options_that_change_no_translation_or_choice():
    """Logging, the fallback policy, tolerances and cache settings share entries; an
    option that changes the translation does not."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    args = [torch.randn(4, 3)]
    base = lort.Options(disk_cache=True)
    same = [
        lort.Options(disk_cache=True, progress=not base.progress),
        lort.Options(disk_cache=True, fallback="raise", rtol=0.5, cache_max_mb=7, schema_cache_size=3),
    ]
    for opts in same:
        assert disk_cache.inputs_key(gm, args, opts, "graph executor") == disk_cache.inputs_key(gm, args, base, "graph executor")
        assert disk_cache.graph_key(gm, opts) == disk_cache.graph_key(gm, base)
    other = lort.Options(disk_cache=True, ort_fusions=False)
    assert disk_cache.inputs_key(gm, args, other, "graph executor") != disk_cache.inputs_key(gm, args, base, "graph executor")
    assert disk_cache.graph_key(gm, other) != disk_cache.graph_key(gm, base)


def test_a_choice_timed_on_another_machine_is_not_read(tmp_path, monkeypatch):
    """A cache directory shared between machines (a network home, a CI cache restored on
    another runner): the engine timed fastest on one CPU is not taken on another, where
    it may be the slowest (BERT-base's training graph in ORT: 1.33x eager on an AVX-512
    EPYC, 1.74x slower than eager on an Intel Xeon)."""
    cold, _, _ = run(tmp_path)
    assert not any(m.from_cache for m in group_modules(cold))
    here = disk_cache.machine_key()
    monkeypatch.setattr(disk_cache, "machine_key", lambda: here[:-1] + ("another CPU",))
    other, _, _ = run(tmp_path)
    assert group_modules(other) and not any(m.from_cache for m in group_modules(other))
    monkeypatch.setattr(disk_cache, "machine_key", lambda: here)
    again, _, _ = run(tmp_path)
    assert all(m.from_cache for m in group_modules(again))


def test_the_machine_key_names_the_cpu_and_its_vector_extensions(tmp_path):
    block = ("processor\t: {i}\nvendor_id\t: {vendor}\ncpu family\t: {fam}\nmodel\t\t: {model}\n"
             "model name\t: {name}\nflags\t\t: {flags}\n\n")
    keys = []
    for vendor, fam, model, name, flags in [("AuthenticAMD", 26, 2, "AMD EPYC", "fpu avx2 fma avx512f"),
                                            ("AuthenticAMD", 25, 1, "AMD EPYC", "fpu avx2 fma"),
                                            ("GenuineIntel", 6, 143, "Intel Xeon", "avx2 fma avx512f amx_tile")]:
        info = tmp_path / f"cpuinfo-{fam}"
        info.write_text(block.format(i=0, vendor=vendor, fam=fam, model=model, name=name, flags=flags)
                        + block.format(i=1, vendor="x", fam=0, model=0, name="second", flags=""))
        key = disk_cache._cpu.__wrapped__(str(info))
        assert vendor in key and str(fam) in key and name in key and "second" not in key
        assert ("avx512f" in key) == ("avx512f" in flags) and ("amx_tile" in key) == ("amx_tile" in flags)
        keys.append(key)
    assert len(set(keys)) == 3
    # no /proc/cpuinfo (another OS): the platform's names, still a key
    assert disk_cache._cpu.__wrapped__(str(tmp_path / "absent"))[0]
