"""What a compiled model holds goes with the model (compile/lifetime.py): ORT sessions,
frozen weights and the model's own weights, for both front ends. Dynamo keeps what a
backend returns for good (a global of the frame it compiled), so without this every
dropped model's sessions and weights stayed: about 25 MB per 8 MB model."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import onnxruntime as ort
import pytest
import torch

import lort
from lort.runtime.group import OrtGroup


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))


def _train_and_eval(model, front: str, options: dict):
    x = torch.randn(16, 512)
    f = lort.ORTModule(model, options=options) if front == "ortmodule" else \
        torch.compile(model, backend="lort", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    f(x).pow(2).mean().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        f(x)
    return f


def _live_sessions() -> int:
    # The shared CPU arena's one tiny shrinking session (runtime/memory.py) is made on
    # the process's first give-back: made here, so that a test run first counts it on
    # both sides (run alone, this test counted it as the dropped model's).
    from lort.runtime import memory

    if memory._shared_cpu_arena():
        memory.shrink_shared_cpu_arena()
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, ort.InferenceSession))


@pytest.mark.parametrize("front", ["torch.compile", "ortmodule"])
@pytest.mark.parametrize("executor", ["ort", "auto"])
def test_a_dropped_model_releases_its_sessions_and_weights(front, executor):
    """A training step and an inference call (frozen weights) through ORT, then the model
    dropped: no ORT session of it and none of its weights stay alive."""
    before = _live_sessions()
    model = _mlp()
    weight = weakref.ref(model[0].weight)
    compiled = _train_and_eval(model, front, {"executor": executor, "disk_cache": False})
    if executor == "ort":
        assert _live_sessions() > before
    del model, compiled
    gc.collect()
    assert weight() is None
    assert _live_sessions() == before
    groups = [o for o in gc.get_objects() if isinstance(o, OrtGroup)]
    assert all(not g.sessions and not g._frozen_sessions and g._guard is None for g in groups)


def test_an_evicted_ortmodule_schema_releases_its_sessions():
    """An ORTModule keeps schema_cache_size schemas; an evicted one's sessions go."""
    before = _live_sessions()
    model = _mlp().eval()
    wrapped = lort.ORTModule(model, options={"executor": "ort", "disk_cache": False, "schema_cache_size": 1})
    with torch.no_grad():
        wrapped(torch.randn(4, 512))
        with_one = _live_sessions()
        wrapped(torch.randn(2, 4, 512))  # another rank: another schema, the first evicted
    assert _live_sessions() <= with_one
    del wrapped, model
    assert _live_sessions() == before


CHILD = r"""
import ctypes, gc, sys, warnings
warnings.simplefilter("ignore")
import torch
sys.path.insert(0, sys.argv[1])
from lort.testing.models import make_torchvision_importable
make_torchvision_importable()
import lort
from test_lifetime import _mlp, _train_and_eval
def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096
front, n = sys.argv[2], int(sys.argv[3])
for _ in range(3):  # warm-up: the first compiles build lort's and Dynamo's caches
    _train_and_eval(_mlp(), front, {})
start = rss()
for _ in range(n):
    _train_and_eval(_mlp(), front, {})
    torch._dynamo.reset()
print((rss() - start) / n)
"""


@pytest.mark.parametrize("front", ["torch.compile", "ortmodule"])
def test_dropped_models_do_not_grow_the_process(front, tmp_path):
    """In a fresh process, 20 models of 8 MB each trained a step, called once in eval
    mode and dropped (lort's defaults: disk cache, executor="auto"): RSS grows by less
    than 2 MB a model (measured 0.8-0.9 MB against Dynamo's own 0.3 MB with its eager
    backend; lort kept about 25 MB a model before)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", CHILD, here, front, "20"], capture_output=True, text=True,
                         env=dict(os.environ, LORT_PROGRESS="0", LORT_EXECUTOR="auto", LORT_DISK_CACHE="1",
                                  LORT_CACHE_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    per_model = float(out.stdout.strip().splitlines()[-1])
    assert per_model < 2 * 2**20, f"{per_model / 2**20:.2f} MB per dropped model"


@pytest.mark.parametrize("grad", [True, False])
def test_compiles_with_equal_options_share_sessions_until_both_models_go(tmp_path, grad):
    """DORT kept one backend per options: two torch.compile calls with equal options
    shared its sessions. lort shares a group's session between compiles with equal
    options (through the disk cache's key), builds another for other session settings,
    and the shared session goes with the last model that runs it. Inference sessions
    hold frozen weights and are not shared: a write through ``p.data`` between the two
    compiles would leave the second a session of the old weights."""
    from lort.compile import shared_sessions
    from lort.runtime.session import stats

    options = {"executor": "ort", "disk_cache": True, "cache_dir": str(tmp_path)}
    model, x = _mlp(), torch.randn(16, 512)
    want = model(x)

    def compile_and_run(opts):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="lort", options=opts)
        with torch.set_grad_enabled(grad):
            out = compiled(x)
        torch.testing.assert_close(out, want)
        return compiled

    first = compile_and_run(options)
    built = stats.sessions_created
    if not grad:  # frozen weights written behind the version counter: seen, not shared
        with torch.no_grad():
            model[0].weight.data.mul_(0.5)
        want = model(x)
    second = compile_and_run(dict(options))
    if not grad:
        assert stats.sessions_created > built
        return
    assert stats.sessions_created == built  # the first compile's session, shared
    third = compile_and_run({**options, "force_spinning_stop": False})
    assert stats.sessions_created > built + 0  # other session settings: a session of its own
    assert shared_sessions.count() >= 1
    shared = [weakref.ref(s) for s in list(shared_sessions._sessions.values())]
    del first, second, third, model
    torch._dynamo.reset()
    gc.collect()
    assert all(r() is None for r in shared)
    assert shared_sessions.count() == 0
