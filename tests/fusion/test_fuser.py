"""The fuser's rules (seed 001), each on a graph built to exercise it."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lort.fusion import fuser

aten = torch.ops.aten


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def supported_except(*names):
    """A support predicate: every ATen call except the given op names."""

    def pred(node):
        return node.op == "call_function" and not any(n in str(node.target) for n in names)

    return pred


def group_ops(groups):
    return [sorted(str(n.target) for n in g.nodes) for g in groups]


def check_partition_runs(gm, groups, *args):
    """Replacing groups with their PyTorch modules keeps the results."""
    modules = {}
    for g in groups:
        sub, where = fuser.build_group_module(gm, g)

        class Run(torch.nn.Module):
            def __init__(self, sub, where):
                super().__init__()
                self.sub, self.where = sub, where

            def forward(self, *a):
                out = self.sub(*a)
                return tuple(out[i] for i in self.where)

        modules[g.name] = Run(sub, where)
    part = fuser.replace_groups(gm, groups, modules)
    expected = gm(*args)
    got = part(*args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    return part


def test_chain_becomes_one_group():
    gm = trace(lambda x: torch.relu(x * 2 + 1).sum(0), torch.randn(3, 4))
    groups = fuser.find_groups(gm.graph, supported_except())
    assert len(groups) == 1
    assert len(groups[0].nodes) == 4
    check_partition_runs(gm, groups, torch.randn(3, 4))


def test_merge_that_would_create_a_cycle_is_refused():
    # a = x*2 -> b = exp(a) (unsupported) -> c = a + b. Merging a and c into one group
    # would need b both after and before the group: a cycle.
    def f(x):
        a = x * 2
        b = torch.exp(a)
        return a + b

    gm = trace(f, torch.randn(4))
    groups = fuser.find_groups(gm.graph, supported_except("exp"))
    assert group_ops(groups) == [["aten.mul.Tensor"], ["aten.add.Tensor"]]
    check_partition_runs(gm, groups, torch.randn(4))


def test_merge_without_cycle_across_unsupported_sibling():
    # a feeds an unsupported op and c; c does not depend on it: one group a+c is fine.
    def f(x):
        a = x * 2
        b = torch.exp(x)
        return a + 1, b

    gm = trace(f, torch.randn(4))
    groups = fuser.find_groups(gm.graph, supported_except("exp"))
    assert group_ops(groups) == [["aten.add.Tensor", "aten.mul.Tensor"]]
    check_partition_runs(gm, groups, torch.randn(4))


def test_argument_limit_splits_groups():
    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc + x
        return acc

    xs = [torch.randn(2) for _ in range(10)]
    gm = trace(f, *xs)
    whole = fuser.find_groups(gm.graph, supported_except(), max_args=128)
    assert len(whole) == 1
    limited = fuser.find_groups(gm.graph, supported_except(), max_args=4)
    assert len(limited) > 1
    for g in limited:
        assert len(g.inputs) + len(g.outputs) <= 4
    check_partition_runs(gm, limited, *xs)


def test_no_merge_across_mutation():
    # y = x + 1 reads x before copy_ mutates it; z = x * 3 reads it after. Fusing y and z
    # into one group would read x on one side of the mutation only.
    def f(x, src):
        y = x + 1
        x.copy_(src)
        z = x * 3
        return y + z

    gm = trace(f, torch.randn(4), torch.randn(4))
    groups = fuser.find_groups(gm.graph, supported_except("copy_"))
    # Without the ordering edges, `add` (reads x before the copy_) would join the group
    # of `mul` (reads it after), placed after the copy_, and read the new x.
    group_of = {n.name: g.name for g in groups for n in g.nodes}
    assert group_of["add"] != group_of["mul"]
    x, src = torch.randn(4), torch.randn(4)
    expected = f(x.clone(), src)
    modules = {}
    for g in groups:
        sub, where = fuser.build_group_module(gm, g)
        modules[g.name] = sub
    part = fuser.replace_groups(gm, groups, modules)
    torch.testing.assert_close(part(x.clone(), src), expected)


def test_multi_output_node_stays_with_its_getitems():
    def f(x):
        v, i = torch.max(x, dim=1)
        return v * 2, i

    gm = trace(f, torch.randn(3, 4))
    groups = fuser.find_groups(gm.graph, supported_except())
    assert len(groups) == 1
    nodes = groups[0].nodes
    assert any(n.target is operator.getitem for n in nodes)
    assert all(n.target is not operator.getitem or n.args[0] in nodes for n in nodes)
    check_partition_runs(gm, groups, torch.randn(3, 4))


def test_view_only_group_is_dissolved():
    def f(x):
        return torch.exp(x).t()

    gm = trace(f, torch.randn(3, 4))
    groups = fuser.find_groups(gm.graph, supported_except("exp"))
    assert groups == []


def test_siblings_are_merged_when_independent():
    def f(x, y):
        return torch.sin(x) + 1, torch.cos(y) * 2

    gm = trace(f, torch.randn(3), torch.randn(3))
    groups = fuser.find_groups(gm.graph, supported_except())
    assert len(groups) == 1
    check_partition_runs(gm, groups, torch.randn(3), torch.randn(3))


def test_fixpoint_no_further_merge_possible():
    def f(x, w):
        h = torch.exp(x @ w)  # exp unsupported: splits the graph
        a = h.sum(0)
        b = torch.exp(a)
        return (b * 2 + a).relu()

    gm = trace(f, torch.randn(4, 4), torch.randn(4, 4))
    pred = supported_except("exp")
    f_ = fuser.Fuser(gm.graph, pred)
    groups = f_.run()
    for g in groups:
        for n in g:
            for p in n.all_input_nodes:
                if p in f_.group_of and f_.group_of[p] is not g:
                    assert not f_.try_merge(p, n)


def test_cse_dce_and_duplicate_outputs():
    def f(x):
        a = x * 2
        b = x * 2  # same as a
        unused = x - 5  # noqa: F841 - dead in the group
        return a + 1, b + 1

    gm = trace(f, torch.randn(4))
    groups = fuser.find_groups(gm.graph, supported_except())
    assert len(groups) == 1
    sub, where = fuser.build_group_module(gm, groups[0])
    calls = [n for n in sub.graph.nodes if n.op == "call_function"]
    assert len(calls) == 2  # one mul, one add: CSE merged both branches, DCE dropped sub
    assert len(where) == len(groups[0].outputs) == 2 and where[0] == where[1]
    check_partition_runs(gm, groups, torch.randn(4))
