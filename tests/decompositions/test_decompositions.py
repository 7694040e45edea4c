"""lort's own decompositions against the ATen ops they replace (float64, tight)."""

import pytest
import torch

from lort.capture import decompositions as dec

aten = torch.ops.aten


@pytest.mark.parametrize(
    "nd, stride, padding, dilation, groups, c_in, c_out, k, size",
    [
        (2, 1, 0, 1, 1, 3, 4, 3, 9),
        (2, 2, 1, 1, 2, 4, 8, 3, 9),
        (2, 2, 1, 1, 4, 4, 4, 3, 10),  # depthwise
        (2, 2, 2, 2, 1, 4, 4, 5, 11),  # dilation
        (2, 3, 1, 1, 1, 2, 3, 4, 13),  # stride that leaves an output padding
        (1, 2, 1, 1, 1, 3, 5, 3, 17),
        (3, 1, 1, 1, 1, 2, 3, 3, 6),
    ],
)
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)])
def test_convolution_backward(nd, stride, padding, dilation, groups, c_in, c_out, k, size, mask):
    torch.manual_seed(0)
    x = torch.randn([2, c_in] + [size] * nd, dtype=torch.float64)
    w = torch.randn([c_out, c_in // groups] + [k] * nd, dtype=torch.float64)
    s, p, d = [stride] * nd, [padding] * nd, [dilation] * nd
    y = aten.convolution(x, w, None, s, p, d, False, [0] * nd, groups)
    g = torch.randn_like(y)
    args = (g, x, w, [c_out], s, p, d, False, [0] * nd, groups, list(mask))
    expected = aten.convolution_backward(*args)
    got = dec.convolution_backward(*args)
    for e, o in zip(expected, got):
        if e is None:
            assert o is None
        else:
            assert o.shape == e.shape
            torch.testing.assert_close(o, e, rtol=1e-10, atol=1e-10)


def test_transposed_convolution_backward_is_not_decomposed():
    x = torch.randn(1, 2, 5, 5)
    w = torch.randn(2, 3, 3, 3)
    g = torch.randn(1, 3, 7, 7)
    args = (g, x, w, [3], [1, 1], [0, 0], [1, 1], True, [0, 0], 1, [True, True, True])
    assert dec.convolution_backward(*args) is NotImplemented


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_fast_path(norm_first, activation):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 4, 32, dropout=0.0, batch_first=True, activation=activation, norm_first=norm_first
    ).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    sa, l1, l2 = layer.self_attn, layer.linear1, layer.linear2
    args = (
        x, 16, 4, sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight, sa.out_proj.bias,
        activation == "gelu", norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
        layer.norm2.weight, layer.norm2.bias, l1.weight, l1.bias, l2.weight, l2.bias,
    )
    with torch.no_grad():
        expected = aten._transformer_encoder_layer_fwd(*args, None, None)
        got = dec.transformer_encoder_layer_fwd(*args, None, None)
        reference = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)
    assert dec.transformer_encoder_layer_fwd(*args, torch.zeros(5, 5, dtype=torch.bool), 0) is NotImplemented


@pytest.mark.parametrize("device, approximate", [("cpu", "none"), ("cuda", "tanh")])
def test_transformer_encoder_fast_path_gelu_follows_the_device(device, approximate):
    """The fast path's first feed-forward product is ``_addmm_activation``: exact GELU on
    CPU, the tanh approximation on CUDA (as PyTorch's own decomposition of it says). The
    decomposition is traced here on fake tensors of each device (no GPU needed), and the
    GELU it writes is read off the graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, activation="gelu").eval()
    sa, l1, l2 = layer.self_attn, layer.linear1, layer.linear2
    args = [torch.randn(2, 5, 16), 16, 4, sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight,
            sa.out_proj.bias, True, False, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
            layer.norm2.weight, layer.norm2.bias, l1.weight, l1.bias, l2.weight, l2.bias]
    mode = FakeTensorMode()
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    fakes = [mode.fake_tensor_converter.from_meta_and_device(mode, args[i].detach().to("meta"), torch.device(device))
             for i in where]

    def layer_fwd(*tensors):
        full = list(args)
        for i, t in zip(where, tensors):
            full[i] = t
        return dec.transformer_encoder_layer_fwd(*full, None, None)

    with mode:
        gm = make_fx(layer_fwd, tracing_mode="fake")(*fakes)
    gelus = [n.kwargs.get("approximate", "none") for n in gm.graph.nodes if n.target == aten.gelu.default]
    assert gelus == [approximate]


def test_table_from_op_names_equals_table_from_registry():
    """A warm start builds the decomposition table from the op names the disk cache
    kept; it must be the table torch_lib's registry gives."""
    from lort.fusion import known_wrong, support
    from lort.translate import _compat, registry

    reg = registry.registry()
    always_wrong = known_wrong.always_wrong()
    implemented = set(_compat._ex_decomp.get_onnx_implemented_overloads(reg)) - always_wrong
    direct = _compat._ex_decomp.create_onnx_friendly_decomposition_table(implemented)
    names = support.implemented_overload_names()
    assert len(names) > 300
    assert _compat.decomposition_table(names).keys() == direct.keys()


def test_table_skips_op_names_this_process_has_not_loaded():
    """The disk cache's op names may come from a process that had loaded a library this
    one has not (quantized_decomposed, loaded by importing inductor): such a name is
    skipped, not an AttributeError at the first compile."""
    from lort.fusion import support
    from lort.translate import _compat

    names = support.implemented_overload_names()
    unknown = ("quantized_decomposed::no_such_op_in_lort_tests", "no_such_namespace_lort::op.default")
    assert _compat.decomposition_table(names + unknown).keys() == _compat.decomposition_table(names).keys()


def _traced_max_pool(before):
    """The inference graph of ``max_pool2d(before(x), 2)`` traced with lort's
    decomposition table."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x):
        return aten.max_pool2d_with_indices.default(before(x), [2, 2])[0]

    return make_fx(fn, decomposition_table=dec.table())(torch.randn(1, 16, 8, 8))


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


@pytest.mark.parametrize(
    "before, convolutions",
    [
        (torch.relu, 1),  # values >= 0 or NaN: one convolution at the pooled size
        (lambda x: aten.hardtanh.default(x, 0.0, 6.0), 1),  # relu6
        (lambda x: aten.clamp.default(x, 0.5), 1),
        (lambda x: aten.clamp_min.default(x, 0.0), 1),
        (lambda x: aten.clamp_min.default(x, -1.0), 4),
        (lambda x: aten.clamp.default(x, 0.0, -1.0), 4),  # clamp to max -1: negative
        (lambda x: aten.hardtanh.default(x), 4),  # -1..1
        (torch.sigmoid, 4),  # not recognised: the general form
        (lambda x: x, 4),
    ],
)
def test_max_pool_fix_after_a_relu_is_one_convolution(before, convolutions):
    """The max_pool NaN and -inf fix reads its input's producer while tracing: after an
    op whose values are >= 0 or NaN no window is -inf only, and the fix is one depthwise
    convolution of the window's sum; elsewhere the general form's four. tests/ops/test_ops.py
    (nan_relu_max_pool2d*) checks both forms' results against eager."""
    gm = _traced_max_pool(before)
    assert _count(gm, aten.convolution.default) == convolutions, gm.code


def _magnitudes() -> torch.Tensor:
    """(1, 16, 12, 12) float32 after a ReLU's worth of values: zeros, subnormals, the
    smallest normal, values from 1e-30 to the largest float32, +inf and NaN, in random
    places, so windows mix magnitudes 1e60 apart."""
    torch.manual_seed(0)
    x = torch.randn(1, 16, 12, 12).abs() * torch.pow(10.0, torch.randint(-30, 39, (1, 16, 12, 12)).double()).float()
    flat = x.view(-1)
    specials = [0.0, 1e-45, 1e-40, torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max,
                float("inf"), float("nan")]
    places = torch.randperm(flat.numel())[: 8 * len(specials)]
    for i, p in enumerate(places.tolist()):
        flat[p] = specials[i % len(specials)]
    return x


@pytest.mark.parametrize("kernel, stride, padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_max_pool_after_a_relu_is_exactly_eagers(kernel, stride, padding):
    """The correction after a ReLU adds a tiny multiple of the window's sum to ORT's
    pooled maximum (decompositions._WINDOW_WEIGHT): that must round back to the maximum
    bit for bit, on windows mixing subnormals with the largest float32, and be +inf with
    +inf and NaN with a NaN, as eager's max_pool2d."""
    from lort.backend import LortBackend

    def fn(x):
        return torch.nn.functional.max_pool2d(torch.relu(x), kernel, stride, padding)

    x = _magnitudes()
    backend = LortBackend({"executor": "ort", "disk_cache": False, "progress": False})
    with torch.no_grad():
        got = torch.compile(fn, backend=backend)(x)
        want = fn(x)
    assert got.isnan().any() and got.isinf().any() and (got == torch.finfo(torch.float32).max).any()
    assert torch.equal(got.isnan(), want.isnan())
    same = ~want.isnan()
    assert torch.equal(got[same], want[same]), (got[same] - want[same]).abs().max()
    (record,) = backend.records
    assert record.torch_nodes == 0
    assert _count(record.graph_module, aten.convolution.default) == 1, record.graph_module.code
