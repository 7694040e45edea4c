"""What lort decides for CUDA before any GPU runs, checked on CPU: which TF32 flags a
group's sessions follow, which dtypes ONNX's schemas refuse, and how ORT's kernel
registry is read where onnxruntime-gpu is installed. Each was found wrong by
tests/cuda/test_cuda.py on an H200 (benchmarks/results/cuda.md); the GPU-side checks stay in
tests/cuda/test_cuda.py."""

from __future__ import annotations

import onnxruntime
import pytest
import torch

from lort.fusion import support
from lort.runtime import cuda


def _aten_graph(model: torch.nn.Module, *args) -> torch.fx.GraphModule:
    """The forward ATen graph AOTAutograd gives a backend for ``model``."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def fw(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=lambda gm, ex: aot_module_simplified(gm, ex, fw_compiler=fw))(*args)
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


@pytest.fixture
def tf32_flags():
    """Restores the matmul flags (legacy API only: mixing it with the new fp32_precision
    API is an error in torch); cuDNN's flag is set through ``cudnn_tf32`` only (PyTorch's
    OpInfo tests, run earlier in the suite, forbid setting it directly). tests/cuda/test_cuda.py
    uses both."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]


def cudnn_tf32(on: bool):
    """cuDNN's TF32 flag set to ``on`` within the block, its other flags as they are."""
    c = torch.backends.cudnn
    return c.flags(enabled=c.enabled, benchmark=c.benchmark, deterministic=c.deterministic, allow_tf32=on)


def test_a_group_follows_the_tf32_flags_of_the_work_it_has(tf32_flags):
    """PyTorch's defaults (TF32 for cuDNN's convolutions, not for matmuls): a group of
    convolutions alone uses TF32 as eager's convolutions do; one with a matmul does not
    (ORT has one switch for a session); one with neither never does."""
    x = torch.randn(1, 3, 8, 8)
    convs = _aten_graph(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), x)
    both = _aten_graph(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 5)), x)
    linear = _aten_graph(torch.nn.Linear(8, 5), x)
    neither = _aten_graph(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Softmax(-1)), x)
    assert cuda.tf32_kinds(convs) == {cuda.CUDNN}
    assert cuda.tf32_kinds(both) == {cuda.CUDNN, cuda.MATMUL}
    assert cuda.tf32_kinds(linear) == {cuda.MATMUL}
    assert cuda.tf32_kinds(neither) == frozenset()
    # TF32 concerns float32 only: work in any other dtype (autocast's float16 on a GPU;
    # float64 here, where eager has CPU kernels for it) has no kind.
    other = _aten_graph(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                           torch.nn.Linear(144, 5)).to(torch.float64), x.double())
    assert cuda.tf32_kinds(other) == frozenset()

    def enabled():
        return [cuda.tf32_enabled(cuda.tf32_kinds(g)) for g in (convs, both, linear, neither)]

    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    with cudnn_tf32(True):  # PyTorch's defaults
        assert enabled() == [True, False, False, False]
    with cudnn_tf32(False):
        assert enabled() == [False, False, False, False]
        torch.backends.cuda.matmul.allow_tf32 = True
        assert enabled() == [False, False, True, False]
    with cudnn_tf32(True):
        assert enabled() == [True, True, True, False]
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("high")
        assert enabled() == [True, True, True, False]


def test_dtypes_onnx_schemas_refuse_have_no_kernel_on_any_provider(monkeypatch):
    """ONNX's Conv and MaxPool take no bfloat16. On CUDA, where lort could not read ORT's
    kernel registry, autocast's bfloat16 convolutions went to a session build that ORT
    refused (a failed build per group, and the reason 'translation failed'); the schema
    says so before any build."""
    monkeypatch.setattr(support, "_kernel_defs", lambda: None)  # the registry unreadable
    support._ort_kernel_types.cache_clear()
    try:
        gpu = torch.device("cuda")
        assert not support.ort_has_kernel("Conv", torch.bfloat16, gpu)
        assert not support.ort_has_kernel("MaxPool", torch.bfloat16, gpu)
        assert support.ort_has_kernel("Conv", torch.float16, gpu)
        assert support.ort_has_kernel("MatMul", torch.bfloat16, gpu)
        assert support.ort_has_kernel("Gemm", torch.bfloat16, gpu)
    finally:
        support._ort_kernel_types.cache_clear()
    assert support.onnx_allows("NotAnOnnxOp", torch.bfloat16)


def test_the_kernel_registry_of_a_gpu_build_is_read_in_a_child_process(monkeypatch):
    """onnxruntime-gpu's get_all_opkernel_def() crashed the process (a segmentation
    fault, seen on an H200); with a GPU build installed lort reads it in a child process.
    Here the child reads the CPU build's registry: the same rows as in this process."""
    support._kernel_defs.cache_clear()
    try:
        in_process = support._kernel_defs()
        support._kernel_defs.cache_clear()
        monkeypatch.setattr(onnxruntime, "get_available_providers",
                            lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
        calls = []
        real_run = support.subprocess.run
        monkeypatch.setattr(support.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
        in_child = support._kernel_defs()
    finally:
        support._kernel_defs.cache_clear()
    assert len(calls) == 1
    assert in_process and sorted(map(repr, in_child)) == sorted(map(repr, in_process))


def test_a_crashing_kernel_registry_read_leaves_the_session_build_to_decide(monkeypatch):
    support._kernel_defs.cache_clear()
    support._ort_kernel_types.cache_clear()
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(support, "_READ_KERNEL_DEFS", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    try:
        assert support._kernel_defs() is None
        assert support._ort_kernel_types("Conv", "CPUExecutionProvider") is None
        assert support.ort_has_kernel("Conv", torch.float32, torch.device("cpu"))
    finally:
        support._kernel_defs.cache_clear()
        support._ort_kernel_types.cache_clear()


def test_where_the_tf32_flags_differ_convolutions_and_matmuls_fall_in_groups_of_their_own(tf32_flags):
    """A ResNet under PyTorch's defaults: in one group, its classifier's matmul (TF32 off)
    would keep its convolutions (TF32 on in eager) in float32 too; on an H200, ResNet-50's
    convolutions in float32 took 1.87 ms of whole ORT's 2.27 ms at batch 1, and
    executor="auto" placed lort's group in eager. The fuser keeps the kinds apart."""
    from lort.fusion import fuser

    x = torch.randn(1, 3, 8, 8)
    gm = _aten_graph(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3),
                                         torch.nn.Flatten(), torch.nn.Linear(64, 5), torch.nn.ReLU()), x)

    def kinds(groups):
        return sorted(sorted(str(k) for k in {cuda.tf32_kind(n) for n in g.nodes} - {None}) for g in groups)

    together = fuser.find_groups(gm.graph, lambda n: True)
    apart = fuser.find_groups(gm.graph, lambda n: True, apart=cuda.tf32_kind)
    assert kinds(together) == [["cudnn", "matmul"]]
    assert kinds(apart) == [["cudnn"], ["matmul"]]
    assert sum(len(g.nodes) for g in apart) == sum(len(g.nodes) for g in together)

    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    with cudnn_tf32(True):
        assert cuda.tf32_flags_differ()
    with cudnn_tf32(False):
        assert not cuda.tf32_flags_differ()
        torch.backends.cuda.matmul.allow_tf32 = True
        assert cuda.tf32_flags_differ()
    with cudnn_tf32(True):
        assert not cuda.tf32_flags_differ()


def test_the_first_cuda_provider_options_quiet_orts_default_logger(monkeypatch, capfd):
    """onnxruntime-gpu 1.31's per-session warning about plugin EP devices goes to ORT's
    default logger, which lort sets to errors the first time it makes CUDA provider
    options. Seen here through another warning of that logger (a session config key set
    twice)."""

    def warn_once() -> str:
        so = onnxruntime.SessionOptions()
        so.add_session_config_entry("session.use_env_allocators", "1")
        so.add_session_config_entry("session.use_env_allocators", "1")
        return capfd.readouterr().err

    onnxruntime.set_default_logger_severity(2)
    try:
        assert "already exists" in warn_once()
        monkeypatch.setattr(cuda, "_default_logger_quieted", False)
        cuda._quiet_ort_default_logger()
        assert "already exists" not in warn_once()
    finally:
        onnxruntime.set_default_logger_severity(2)


def test_bfloat16_kernels_of_the_cuda_registry_are_found(monkeypatch):
    """bfloat16 goes to ORT on CUDA only; the kernel check looked it up under no type
    name, so a readable CUDA registry would have refused every bfloat16 op."""
    rows = [("MatMul", "", "CUDAExecutionProvider", (13, 2**31 - 1), {"T": ["tensor(float)", "tensor(bfloat16)"]}),
            ("Erf", "", "CUDAExecutionProvider", (13, 2**31 - 1), {"T": ["tensor(float)"]})]
    monkeypatch.setattr(support, "_kernel_defs", lambda: rows)
    support._ort_kernel_types.cache_clear()
    try:
        gpu = torch.device("cuda")
        assert support.ort_has_kernel("MatMul", torch.bfloat16, gpu)
        assert not support.ort_has_kernel("Erf", torch.bfloat16, gpu)
        assert support.ort_has_kernel("Erf", torch.float32, gpu)
    finally:
        support._ort_kernel_types.cache_clear()


def test_cuda_provider_options_ask_for_float32_precision_and_keep_the_users(monkeypatch):
    """lort's stream is always lort's; TF32 as decided; SkipLayerNormalization in ORT's
    strict mode (its default takes the variance in one pass) unless the user says."""

    class Stream:
        cuda_stream = 1234

    monkeypatch.setattr(cuda, "lort_stream", lambda index: Stream())
    monkeypatch.setattr(cuda, "_default_logger_quieted", True)  # ORT's logger as it is
    opts = cuda.provider_options(0, tf32=False)
    assert opts == {"device_id": "0", "use_tf32": "0", "enable_skip_layer_norm_strict_mode": "1",
                    "user_compute_stream": "1234"}
    user = {"enable_skip_layer_norm_strict_mode": 0, "user_compute_stream": "9"}
    opts = cuda.provider_options(1, tf32=True, user=user)
    assert opts == {"device_id": "1", "use_tf32": "1", "enable_skip_layer_norm_strict_mode": "0",
                    "user_compute_stream": "1234"}


def test_a_session_that_ran_on_cuda_waits_for_its_stream_before_it_is_freed(monkeypatch):
    """ORT's end-of-run host function holds the session's pinned arena; a session freed
    before its stream has run it made CUDA refuse the arena's cudaFreeHost inside that
    function and ORT abort the process (an H200, twice). A CUDA session that ran drains
    lort's stream of its device when freed; one that never ran, or a CPU one, does not.
    Checked on a CPU session given a CUDA session's stream order (the GPU side:
    tests/cuda/test_cuda.py, test_model_dropped_while_its_last_run_is_queued)."""
    import gc

    from lort.options import Options
    from lort.runtime.session import GroupSession, OutputSpec

    drained = []
    monkeypatch.setattr(cuda, "drain", drained.append)
    x = torch.randn(3)

    def session(ran: bool, cuda_order: bool) -> GroupSession:
        from onnx import TensorProto, helper

        graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        s = GroupSession(model.SerializeToString(), torch.device("cpu"), [OutputSpec(torch.float32, (3,))],
                         Options(), "neg", count=False)
        if ran:
            torch.testing.assert_close(s.run([x])[0], -x)
        if cuda_order:
            s._order = type("Order", (), {"index": 1})()  # as a CUDA session of device 1 has
        return s

    for ran, cuda_order, expected in ((True, True, [1]), (False, True, []), (True, False, [])):
        drained.clear()
        s = session(ran, cuda_order)
        del s
        gc.collect()
        assert drained == expected, (ran, cuda_order, drained)


@pytest.mark.parametrize("pinned, arena, expected", [
    ("session", False, None), ("process", False, "1"), ("session", True, "1"), ("process", True, "1")])
def test_cuda_sessions_take_the_environments_allocators_only_where_asked(monkeypatch, pinned, arena, expected):
    """Options.cuda_pinned_memory="process" registers one pinned host allocator per device
    in ORT's environment (and share_cuda_arena one device arena) and builds the session
    with ``session.use_env_allocators``; the default builds it with allocators of its own.
    Checked on CPU with ORT's session and provider list stood in for (what ORT then does
    with the allocators needs a GPU: tests/cuda/test_cuda.py)."""
    from lort.options import Options
    from lort.runtime import providers, session

    registered, built = [], []
    monkeypatch.setattr(session, "_shared_cuda_pinned", lambda i: registered.append(("pinned", i)) or True)
    monkeypatch.setattr(session, "_shared_cuda_arena", lambda i: registered.append(("arena", i)) or True)
    monkeypatch.setattr(providers, "for_device", lambda *a: ["CPUExecutionProvider"])

    class FakeSession:
        def __init__(self, model, sess_options, providers):
            try:
                built.append(sess_options.get_session_config_entry("session.use_env_allocators"))
            except RuntimeError:  # ORT's answer for a key never set
                built.append(None)

        def disable_fallback(self):
            pass

    monkeypatch.setattr(session.ort, "InferenceSession", FakeSession)
    # share_cpu_arena off: it asks for the environment's allocators by itself
    options = Options(cuda_pinned_memory=pinned, share_cuda_arena=arena, share_cpu_arena=False)
    session.create_session(b"", torch.device("cuda", 1), options, "g", None, count=False)
    assert built == [expected]
    assert registered == [("arena", 1)] * arena + [("pinned", 1)] * (pinned == "process")


def test_cuda_pinned_memory_takes_session_or_process_and_a_cpu_build_registers_none(caplog):
    """A wrong value names the allowed ones; on onnxruntime's CPU build ORT refuses a CUDA
    pinned allocator, and lort says so at INFO and keeps each session's own."""
    import logging

    from lort.options import Options
    from lort.runtime import memory

    with pytest.raises(ValueError, match=r"cuda_pinned_memory='shared' is not one of \('process', 'session'\)"):
        Options(cuda_pinned_memory="shared")
    # the fourth GPU run: "session" aborted where "process" passed (benchmarks/results/cuda.md)
    assert Options().cuda_pinned_memory == "process"
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed: the registration is tested on a GPU (tests/cuda/test_cuda.py)")
    memory._arenas.pop("cuda_pinned:0", None)
    with caplog.at_level(logging.INFO, logger="lort"):
        assert memory._shared_cuda_pinned(0) is False
    assert "no shared CUDA pinned (device 0) arena" in caplog.text
    memory._arenas.pop("cuda_pinned:0", None)
