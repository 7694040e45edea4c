"""The frozen-weight check (runtime/frozen.py's WeightGuard) in C++ (weight_check.cpp,
built by runtime/native.py) and in Python: each sees every way a weight changes, and they
agree. tests/ortmodule/test_freeze.py runs the same routes through compiled models."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from lort.runtime import frozen, native
from lort.runtime.frozen import FrozenWeight, WeightGuard

BUILT = native.load() is not None


def test_the_cpp_check_is_built_where_a_compiler_is():
    if not native.enabled():
        pytest.skip(f"{native.ENV_NATIVE}=0 turns the C++ check off")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here: lort checks frozen weights in Python")
    assert BUILT, "make install builds it (python -m lort.runtime.build_native)"


@pytest.fixture(params=["cpp", "python"])
def check(request, monkeypatch):
    if request.param == "cpp" and not BUILT:
        pytest.skip("the C++ check is not built here (python -m lort.runtime.build_native)")
    if request.param == "python":
        monkeypatch.setattr(native, "load", lambda: None)
    return request.param


def _guard(tensors: list[torch.Tensor], check: str, sample: bool = True) -> WeightGuard:
    guard = WeightGuard(tuple(FrozenWeight(i, f"w{i}", t) for i, t in enumerate(tensors)), sample=sample)
    assert (guard._native is not None) == (check == "cpp")
    return guard


def _weights():
    torch.manual_seed(0)
    base = torch.randn(40)
    return [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.randn(3, 4).t(),  # not contiguous
        base[8:20],  # a view at a storage offset
        torch.randn(5).half(),
        torch.arange(6) - 2,
        torch.tensor([True, False]),
        torch.randn(3, device="meta"),  # not sampled (no CPU memory), like a CUDA weight
    ]


def _in_place(ws):
    with torch.no_grad():
        ws[0].mul_(2)


def _view_in_place(ws):
    ws[2].view(3, 4)[1].add_(1)  # through a view: the shared version counter


def _data_write(ws):
    ws[0].data.mul_(0.5)  # no version bump: the sampled element sees it


def _numpy_write(ws):
    ws[1].numpy()[:] *= -3.0


def _half_write(ws):
    ws[3].data.fill_(7)


def _int_write(ws):
    ws[4].data.fill_(9)


def _bool_write(ws):
    ws[5].data.fill_(False)


def _set_data(ws):
    ws[0].data = torch.randn(4, 3)


def _set_data_same_storage(ws):
    ws[2].data = torch.empty(0).set_(ws[2].untyped_storage(), 9, (12,))  # one element on


def _swap(ws):
    torch.utils.swap_tensors(ws[1], torch.randn(3, 4).t())


def _storage_freed(ws):
    ws[1].untyped_storage().resize_(0)


def _replaced(ws):
    ws[4] = ws[4].clone()


def _meta_replaced(ws):
    ws[6] = torch.randn(3, device="meta")


ROUTES = [_in_place, _view_in_place, _data_write, _numpy_write, _half_write, _int_write, _bool_write, _set_data,
          _set_data_same_storage, _swap, _storage_freed, _replaced, _meta_replaced]
#: The weight each route changes.
CHANGED = {_in_place: 0, _view_in_place: 2, _data_write: 0, _numpy_write: 1, _half_write: 3, _int_write: 4,
           _bool_write: 5, _set_data: 0, _set_data_same_storage: 2, _swap: 1, _storage_freed: 1, _replaced: 4,
           _meta_replaced: 6}


@pytest.mark.parametrize("route", ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_every_change_is_seen(check, route):
    ws = _weights()
    guard = _guard(ws, check)
    assert guard.same_picked(tuple(ws)) and guard.changed(ws) is None
    assert guard.same_picked(list(ws))  # a list serves too
    # Neither check leaves a storage unresizable (the Python one reads its samples
    # through lort.numpy_views, and compares data pointers before it reads them).
    assert all(w.untyped_storage().resizable() for w in ws if w.device.type == "cpu")
    route(ws)
    assert not guard.same_picked(tuple(ws))
    assert guard.changed(ws) == f"w{CHANGED[route]}"
    if route is not _storage_freed:  # (nothing to sample in an empty storage)
        guard.reset(ws)
        assert guard.same_picked(tuple(ws)) and guard.changed(ws) is None


def test_a_wrong_count_or_container_is_no_match(check):
    ws = _weights()
    guard = _guard(ws, check)
    assert not guard.same_picked(tuple(ws[:-1]))
    assert not guard.same_picked(tuple(ws) + (ws[0],))
    if check == "cpp":
        assert not guard._native.same(iter(ws))  # neither a tuple nor a list
        with pytest.raises(ValueError, match="as many tensors as were frozen"):
            guard._native.first_change(tuple(ws[:-1]))


def test_without_samples_writes_behind_the_version_counter_are_unseen(check):
    """freeze=True checks identity, version and data pointer only (the documented
    limit): a ``.data`` write passes, a version bump does not."""
    ws = _weights()
    guard = _guard(ws, check, sample=False)
    _data_write(ws)
    assert guard.same_picked(tuple(ws))
    _in_place(ws)
    assert not guard.same_picked(tuple(ws))


def test_the_cpp_check_refuses_what_it_cannot_read():
    """An inference tensor has no version counter: the C++ check refuses it, the guard
    is then checked in Python (which raises, as torch does, where it reads the version)."""
    if not BUILT:
        pytest.skip("the C++ check is not built here (python -m lort.runtime.build_native)")
    module = native.load()
    with torch.inference_mode():
        t = torch.randn(3)
    with pytest.raises(ValueError, match="version counter"):
        module.WeightCheck([t], [0], [0], [0])
    with pytest.raises(ValueError, match="outside the tensor's storage"):
        module.WeightCheck([torch.randn(3)], [12], [4], [0])
    with pytest.raises(ValueError, match="one sample"):
        module.WeightCheck([torch.randn(3)], [], [], [])
    assert frozen._native_check([torch.randn(3), t], [(0, 0, 0)] * 2) is None


def test_without_a_build_the_python_check_serves(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(native.ENV_NATIVE_DIR, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="lort"):
        assert native.load() is None
    assert "python -m lort.runtime.build_native builds it" in caplog.text
    # A broken build does not load either: said, and Python serves.
    folder = native.build_dir()
    folder.mkdir(parents=True)
    (folder / f"{native.NAME}.so").write_bytes(b"not a library")
    native._loaded.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lort"):
        assert native.load() is None
    assert "does not load" in caplog.text
    ws = _weights()
    assert WeightGuard(tuple(FrozenWeight(i, "w", t) for i, t in enumerate(ws)), sample=True)._native is None
    native._loaded.clear()
    monkeypatch.setenv(native.ENV_NATIVE, "0")
    monkeypatch.delenv(native.ENV_NATIVE_DIR)
    assert native.load() is None


class _Owner(torch.nn.Module):
    def __init__(self, ws):
        super().__init__()
        self.a = torch.nn.Parameter(ws[0])
        self.register_buffer("b", ws[1])


def test_the_registered_check_reads_each_weight_where_its_module_holds_it(check):
    """ORTModule's steady route hands the guard its weights' registries (a module's
    ``_parameters`` and ``_buffers``): a weight replaced there, removed, or changed is
    seen; after ``reset`` over the new ones they pass again."""
    torch.manual_seed(0)
    m = _Owner([torch.randn(3), torch.randn(2, 2)])
    guard = _guard([m.a, m.b], check)
    same = guard.register([m._parameters, m._buffers], ["a", "b"])
    assert same()
    m.b.mul_(2)  # version
    assert not same()
    guard.reset([m.a, m.b])
    assert same()
    m.a.data[torch.argmax(m.a.detach().abs())] = 0.0  # behind the version counter: the sample
    assert not same()
    guard.reset([m.a, m.b])
    m.a = torch.nn.Parameter(m.a.detach().clone())  # replaced in the registry
    assert not same()
    guard.reset([m.a, m.b])
    assert same()
    del m._buffers["b"]  # removed: no match (the caller's full path says so)
    assert not same()
    m.register_buffer("b", guard.tensors[1])
    assert same()
    if check == "cpp":
        with pytest.raises(ValueError, match="one registry"):
            guard._native.set_registries([m._parameters], ["a"])
        fresh = native.load().WeightCheck([m.a], [0], [0], [0])
        with pytest.raises(RuntimeError, match="set_registries"):
            fresh.same_registered()


def test_the_registered_check_follows_a_registry_rebuilt(check):
    """The C++ check looks a key up at its last place in the dict's entry table: a dict
    rebuilt (entries deleted, then enough inserted to resize it, which moves every
    entry), a key removed and inserted again, or inserted as another (equal) string
    object, is found again, and the answer stays the registry's."""
    torch.manual_seed(0)
    w, v = torch.randn(3), torch.randn(4)
    reg = {"first": torch.randn(1), "".join(["wei", "ght"]): w, "other": v}
    guard = _guard([w, v], check)
    same = guard.register([reg, reg], ["weight", "other"])
    assert same()
    del reg["first"]
    for k in range(40):  # resizes: the entries move
        reg[f"k{k}"] = torch.zeros(1)
    assert same() and same()
    del reg["weight"]
    assert not same()
    reg["".join(["wei", "ght"])] = w  # an equal key, another object, at the end
    assert same() and same()
    reg["weight"] = torch.randn(3)  # replaced
    assert not same()
    reg["weight"] = w
    assert same()
    v.add_(1)
    assert not same()


def test_a_registry_that_is_no_plain_dict_is_read_in_python(check):
    class Registry(dict):
        def __getitem__(self, key):
            return super().__getitem__(key)

    t = torch.randn(3)
    guard = _guard([t], check)
    same = guard.register([Registry(w=t)], ["w"])
    assert guard.registered_check is None and same()
    t.add_(1)
    assert not same()
