"""Options.release_openmp: long ORT runs release PyTorch's spinning OpenMP workers first
(runtime/openmp.py); which graphs do it, that it changes no result, the option's errors."""

import pytest
import torch

import lort
from lort.backend import LortBackend
from lort.runtime import openmp
from lort.runtime.session import GroupSession


class _Counting:
    """Stands in for the runtime's release function: counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


@pytest.fixture
def counted(monkeypatch):
    """Every run after a session's first releases (MIN_RUN_S 0), counted, not paused."""
    counter = _Counting()
    monkeypatch.setattr(openmp, "_found", [counter])
    monkeypatch.setattr(openmp, "MIN_RUN_S", 0.0)
    return counter


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).softmax(-1)


def _train(options, steps=3):
    """Losses and final weights of ``steps`` SGD steps, compiled and eager, from the same start."""
    torch.manual_seed(0)
    net = _Net()
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    backend = LortBackend({"executor": "ort", **options})
    compiled = torch.compile(net, backend=backend)
    losses = {"lort": [], "eager": []}
    for model, key in ((compiled, "lort"), (ref, "eager")):
        opt = torch.optim.SGD((net if key == "lort" else ref).parameters(), lr=0.1)
        for _ in range(steps):
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.detach())
    return backend, net, ref, losses


def _sessions(backend):
    """kind of graph -> whether its sessions (frozen-weight ones included) release before a run."""
    found = {}
    for r in backend.records:
        for m in r.group_modules.values():
            for sess in [*m.sessions.values(), *m._frozen_sessions.values()]:
                if isinstance(sess, GroupSession):
                    found.setdefault(r.kind, set()).add(sess._release is not None)
    return found


def test_training_graphs_release_openmp_workers_when_asked_and_results_stay_eagers(counted):
    backend, net, ref, losses = _train({"release_openmp": "training"})
    assert _sessions(backend) == {"forward": {True}, "backward": {True}}
    # Each session's runs after its first (two of three steps, forward and backward).
    assert counted.calls >= 4
    torch.testing.assert_close(torch.stack(losses["lort"]), torch.stack(losses["eager"]))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_inference_graphs_release_only_with_true(counted):
    torch.manual_seed(0)
    net, x = _Net().eval(), torch.randn(8, 16)
    for options, released in (({"release_openmp": "training"}, False), ({"release_openmp": True}, True)):
        torch._dynamo.reset()
        backend = LortBackend({"executor": "ort", **options})
        compiled = torch.compile(net, backend=backend)
        before = counted.calls
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(compiled(x), net(x))
        assert _sessions(backend) == {"inference": {released}}
        assert (counted.calls > before) is released


@pytest.mark.parametrize("options", [{}, {"release_openmp": False}])
def test_by_default_and_with_false_nothing_is_released(counted, options):
    backend, net, _, losses = _train(options)  # net holds the sessions: a dropped model releases them
    assert _sessions(backend) == {"forward": {False}, "backward": {False}}
    assert counted.calls == 0
    torch.testing.assert_close(torch.stack(losses["lort"]), torch.stack(losses["eager"]))


@pytest.mark.parametrize("value, message", [
    (1, "release_openmp=1 must be 'training', True or False"),
    ("always", "release_openmp='always' must be 'training', True or False"),
])
def test_release_openmp_names_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        lort.Options(release_openmp=value)


def test_the_loaded_openmp_runtime_takes_the_pause():
    """PyTorch's Linux wheels run on GNU libgomp, which exports OpenMP 5.0's
    omp_pause_resource_all: after a parallel op, the release returns 0 (accepted)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch build's parallel backend is not OpenMP")
    torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region: workers now wait
    release = openmp.release_function()
    if release is None:
        pytest.skip(f"no OpenMP runtime with omp_pause_resource_all among {openmp._loaded_runtimes()}")
    assert release() == 0
    torch.testing.assert_close(torch.ones(256, 256) @ torch.ones(256, 256), torch.full((256, 256), 256.0))


def test_loaded_runtimes_are_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site/torch/lib/libgomp.so.1\n"
        "7f04-7f05 r--p 00001000 08:01 2 /site/torch/lib/libgomp.so.1\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
        "7f08-7f09 r-xp 00000000 08:01 3 /opt/intel/libiomp5.so\n")
    assert openmp._loaded_runtimes(str(maps)) == ["/opt/intel/libiomp5.so", "/site/torch/lib/libgomp.so.1"]
    assert openmp._loaded_runtimes(str(tmp_path / "missing")) == []
