"""Sizes read from the graph's inputs (lort/capture/symbolic_sizes.py): a ``sym_size`` of
a tensor the graph computes no longer cuts the ORT group in two."""

import pytest
import torch

import lort


class _Decoder(torch.nn.Module):
    """Two attention layers that append the new step to their key cache (``cat``) and
    attend over it: the attention's decomposition reads the cache's new length as a size
    of the concatenation, as transformers' decoders do."""

    def __init__(self):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, caches):
        outs = []
        for lin, cache in zip(self.lins, caches):
            k = torch.cat([cache, lin(x)], dim=2)
            x = torch.nn.functional.scaled_dot_product_attention(x, k, k) + x
            outs.append(k)
        return x, outs


def test_a_size_of_a_computed_tensor_is_read_from_the_inputs_and_keeps_one_group():
    be = lort.LortBackend({"executor": "ort"})
    torch.manual_seed(0)
    model = _Decoder()
    compiled = torch.compile(model, backend=be, dynamic=True)
    for cache_len in (3, 5, 9):
        x = torch.randn(1, 2, 1, 8)
        caches = [torch.randn(1, 2, cache_len, 8) for _ in range(2)]
        with torch.no_grad():
            want = model(x, caches)
            got = compiled(x, caches)
        torch.testing.assert_close(got, want)
    (record,) = be.records
    # Without the rewrite, each layer's sym_size(cat, 1) stayed in PyTorch between the
    # layers' ops: two groups. Now the sizes come from the caches' inputs.
    assert len(record.groups) == 1, [g.name for g in record.groups]
    left = [op for op, _ in record.fallbacks]
    assert not any("sym_size" in op for op in left), left


def test_the_rewrite_gives_the_inputs_arithmetic():
    from lort.capture.symbolic_sizes import sizes_from_inputs

    def f(a, b):
        c = torch.cat([a, b], dim=0)
        return c.new_zeros(c.shape[0] * 2)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="symbolic")(torch.randn(3), torch.randn(4))
    computed = [n for n in gm.graph.nodes
                if n.target is torch.ops.aten.sym_size.int and n.args[0].op != "placeholder"]
    assert computed, gm.graph  # the size of the concatenation, read from it
    done = sizes_from_inputs(gm)
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.sym_size.int:
            assert n.args[0].op == "placeholder"
    a, b = torch.randn(5), torch.randn(2)
    assert gm(a, b).shape == f(a, b).shape == (14,)
    assert done == len(computed)


def test_outputs_ort_allocates_are_new_memory_each_run():
    """A group whose output shapes are known only after a run lets ORT allocate them;
    its binding (inputs bound once) clears the last run's outputs before the next, so a
    second run never writes into a tensor the first returned, and inputs whose memory
    changed are bound again."""
    from onnx import TensorProto, helper

    from lort.options import Options
    from lort.runtime.session import GroupSession, OutputSpec

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    sess = GroupSession(model.SerializeToString(), torch.device("cpu"), [OutputSpec(torch.float32, None)],
                        Options(), "neg", count=False)
    assert not sess.static_outputs
    x = torch.arange(4.0)
    first = sess.run([x])[0]
    kept = first.clone()
    second = sess.run([x])[0]  # same input memory: bound once
    assert first.data_ptr() != second.data_ptr()
    x.copy_(torch.arange(10.0, 14.0))  # same memory, new values
    third = sess.run([x])[0]
    y = torch.arange(5.0)  # new memory and shape
    fourth = sess.run([y])[0]
    torch.testing.assert_close(first, kept)
    torch.testing.assert_close(second, kept)
    torch.testing.assert_close(third, -torch.arange(10.0, 14.0))
    torch.testing.assert_close(fourth, -y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_outputs_ort_allocates_keep_their_dtype_and_values(dtype):
    """Outputs ORT allocates are read through DLPack as one vector: each keeps its dtype
    (bool, which DLPack gives as uint8, is read back as bool), values and shape, an empty
    one included, and owns its memory after the next run."""
    from onnx import TensorProto, helper

    from lort.options import Options
    from lort.runtime.dtypes import ELEMENT_TYPES
    from lort.runtime.session import GroupSession, OutputSpec

    etype = ELEMENT_TYPES[dtype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Concat", ["x", "x"], ["z"], axis=0)], "io",
        [helper.make_tensor_value_info("x", etype, ["n"])],
        [helper.make_tensor_value_info("y", etype, ["n"]), helper.make_tensor_value_info("z", etype, ["m"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    sess = GroupSession(model.SerializeToString(), torch.device("cpu"),
                        [OutputSpec(dtype, None), OutputSpec(dtype, None)], Options(), "io", count=False)
    x = torch.tensor([1, 0, 1, 1]).to(dtype)
    y, z = sess.run([x])
    assert y.dtype == z.dtype == dtype
    assert torch.equal(y, x) and torch.equal(z, torch.cat([x, x]))
    assert y.data_ptr() != x.data_ptr()
    again = sess.run([torch.zeros(0, dtype=dtype)])
    assert [t.shape for t in again] == [(0,), (0,)] and all(t.dtype == dtype for t in again)
    assert torch.equal(y, x)  # the first run's outputs are untouched by the second
