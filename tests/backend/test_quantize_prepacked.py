"""Options.quantize_offload_dir, pre-packed weights: the sessions of a quantized model map
their initializers and pre-packed weights from one store file, each blob stored once
(runtime/prepacked.py). Results equal the sessions built in memory; a run drops the page
tables of the other sessions over the same weights; the store goes with its sessions."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lort.options import Options
from lort.runtime import prepacked
from lort.runtime.session import GroupSession, OutputSpec

from test_quantize_offload import _decoder, _options, disk_dir  # noqa: F401 - a fixture

K = N = 512
LAYERS = 4
M = 3


def _arrays(seed=0):
    """int4 arrays of LAYERS K x N matrices (onnxruntime's own block quantizer)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer)

    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True))
    rng = np.random.default_rng(seed)
    return [quantizer.qbits_block_quant(rng.standard_normal((K, N), dtype=np.float32))[:2] for _ in range(LAYERS)]


def _model(arrays, relu: bool) -> bytes:
    """A chain of MatMulNBits over ``arrays``; ``relu``: another graph over the same weights."""
    nodes, inits, prev = [], [], "x"
    for i, (packed, scales) in enumerate(arrays):
        inits += [numpy_helper.from_array(packed, f"w{i}"), numpy_helper.from_array(scales.reshape(-1), f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", [prev, f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=K, N=N, bits=4, block_size=32, accuracy_level=4))
        prev = f"y{i}"
        if relu:
            nodes.append(helper.make_node("Relu", [prev], [prev + "r"]))
            prev += "r"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [M, N])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10).SerializeToString()


def _session(model: bytes, directory: str | None) -> GroupSession:
    options = Options(quantize="int4", executor="ort", quantize_offload_dir=directory)
    return GroupSession(model, torch.device("cpu"), [OutputSpec(torch.float32, (M, N))], options, "g")


def _resident(regions) -> int:
    """Resident bytes of the mappings that start at one of ``regions``' starts."""
    starts, total, current = {s for s, _ in regions}, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                current = int(fields[0].split("-")[0], 16) in starts
            elif current and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _stores(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith("lort-prepacked-")]


def test_sessions_over_the_same_weights_map_one_stored_copy(disk_dir):
    arrays = _arrays()
    x = torch.randn(M, K)
    graphs = [_model(arrays, relu) for relu in (False, True)]
    want = [_session(g, None).run([x])[0] for g in graphs]
    first = _session(graphs[0], disk_dir)
    member = prepacked.member(first.session)
    assert member is not None and member.regions
    store = member.store
    size = store.size
    second = _session(graphs[1], disk_dir)
    # the second graph's weights, initializers and pre-packed blobs, were all stored already
    assert store.size == size
    assert prepacked.member(second.session).blobs == member.blobs
    # ORT maps them: the pre-packed weights are not in the session's own memory
    quantized = sum(a.nbytes for pair in arrays for a in pair)
    assert sum(end - start for start, end in member.regions) >= quantized
    for sess, expected in zip((first, second), want):
        assert torch.equal(sess.run([x])[0], expected)
    assert _stores(disk_dir) == [os.path.basename(store.path)]


def test_a_session_that_keeps_running_drops_the_page_tables_of_the_others_over_its_weights(disk_dir):
    arrays = _arrays()
    x = torch.randn(M, K)
    graphs = [_model(arrays, relu) for relu in (False, True)]
    want = [_session(g, None).run([x])[0] for g in graphs]
    a, b = (_session(g, disk_dir) for g in graphs)
    ma, mb = prepacked.member(a.session), prepacked.member(b.session)
    assert torch.equal(a.run([x])[0], want[0])
    assert ma.resident and _resident(ma.regions) > 0
    for _ in range(prepacked.STREAK - 1):  # a prefill then a few decode steps: both stay
        assert torch.equal(b.run([x])[0], want[1])
    assert ma.resident and _resident(ma.regions) > 0
    assert torch.equal(b.run([x])[0], want[1])
    assert not ma.resident and mb.resident
    assert _resident(ma.regions) == 0 and _resident(mb.regions) > 0
    for _ in range(prepacked.STREAK):  # read back from the file: the same values
        assert torch.equal(a.run([x])[0], want[0])
    assert _resident(mb.regions) == 0 and _resident(ma.regions) > 0
    assert torch.equal(b.run([x])[0], want[1])


def test_a_region_with_a_written_page_keeps_its_pages(disk_dir):
    """Were ORT to write a page of a mapping (it does not), the region keeps it: dropping
    the page would lose the write."""
    import ctypes

    arrays = _arrays()
    x = torch.randn(M, K)
    graphs = [_model(arrays, relu) for relu in (False, True)]
    a, b = (_session(g, disk_dir) for g in graphs)
    ma = prepacked.member(a.session)
    want = a.run([x])[0]
    start = ma.regions[0][0]
    ctypes.memmove(start, ctypes.string_at(start, 8), 8)  # the same bytes, written: a private copy
    for _ in range(prepacked.STREAK):
        b.run([x])
    assert not ma.resident
    written = _resident(ma.regions[:1])
    assert written > 0 and _resident(ma.regions[1:]) == 0
    assert torch.equal(a.run([x])[0], want)


def test_sessions_over_other_weights_keep_their_pages(disk_dir):
    x = torch.randn(M, K)
    a, b = (_session(_model(_arrays(seed), False), disk_dir) for seed in (0, 1))
    ma, mb = prepacked.member(a.session), prepacked.member(b.session)
    assert ma.store is mb.store and ma.blobs.isdisjoint(mb.blobs)
    a.run([x])
    b.run([x])
    assert ma.resident and mb.resident and _resident(ma.regions) > 0


def test_the_store_goes_with_its_last_session(disk_dir):
    x = torch.randn(M, K)
    arrays = _arrays()
    a, b = (_session(_model(arrays, relu), disk_dir) for relu in (False, True))
    a.run([x])
    (path,) = _stores(disk_dir)
    del a
    gc.collect()
    assert _stores(disk_dir) == [path]
    b.run([x])
    del b
    gc.collect()
    assert _stores(disk_dir) == []


def test_a_store_a_dead_process_left_is_removed(disk_dir):
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # no process has it
    for pid in (dead, 1):
        os.makedirs(os.path.join(disk_dir, f"lort-prepacked-{pid}-left"))
    sess = _session(_model(_arrays(), False), disk_dir)
    names = _stores(disk_dir)
    assert f"lort-prepacked-{dead}-left" not in names
    assert "lort-prepacked-1-left" in names  # a live process's
    del sess


@pytest.mark.parametrize("breaks", ["store", "layout"])
def test_a_graph_the_store_cannot_take_is_built_in_memory(disk_dir, monkeypatch, caplog, breaks):
    if breaks == "store":
        def refuse(self, graph, data_path):
            raise prepacked.StoreError("initializer 'w0': external data {'location': 'elsewhere'}")

        monkeypatch.setattr(prepacked.Store, "_move", refuse)
        said = "elsewhere"
    else:  # a key lort does not know, found while the written file is mapped
        monkeypatch.setattr(prepacked, "_PLAIN_KEYS", ("location", "offset"))
        said = "StoreError: initializer 'w0'"
    x = torch.randn(M, K)
    model = _model(_arrays(), False)
    with caplog.at_level("WARNING", logger="lort"):
        sess = _session(model, disk_dir)
    assert "pre-packed weights stay in this session's memory" in caplog.text and said in caplog.text
    assert prepacked.member(sess.session) is None
    assert torch.equal(sess.run([x])[0], _session(model, None).run([x])[0])


def test_a_decoder_maps_its_prefill_and_decode_sessions_from_one_store(disk_dir):
    """generate: the prefill and decode graphs' sessions share each stored blob, and after a
    generate only the decode holds its pages (it ran more than STREAK times in a row);
    tokens as built in memory, also after a norm weight, which no quantization replaces,
    is written in place."""
    model, kept, ids = _decoder()
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    # Dynamo's own dynamic shapes: one decode graph for every cache length, so that the
    # decode session runs more than STREAK times in a row (both models' graphs under the
    # one code object's recompile limit: no fallback to eager in either)
    kept.forward = torch.compile(kept.forward, backend="lort", options=_options())
    model.forward = torch.compile(model.forward, backend="lort", options=_options(quantize_offload_dir=disk_dir))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kw), kept.generate(ids, **kw))
        (store,) = [s for s in prepacked._stores.values() if not s.closed and s.path.startswith(disk_dir)]
        members = list(store.members)
        assert len(members) >= 2
        mapped = [sum(e - s for s, e in m.regions) for m in members]
        assert store.size < 0.75 * sum(mapped)  # shared: each blob once
        assert sum(m.resident for m in members) == 1
        assert sum(_resident(m.regions) > 0 for m in members) == 1
        before = kept.generate(ids, **kw)
        for m in (model, kept):
            m.model.norm.weight.mul_(1.5)
            m.model.layers[0].input_layernorm.weight[::2] = -1.0
        after = kept.generate(ids, **kw)
        assert not torch.equal(after, before)  # the writes change the tokens
        assert torch.equal(model.generate(ids, **kw), after)
