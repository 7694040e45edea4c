"""PyTorch's OpInfo conformance sweep through lort.

Every op in ``torch.testing._internal.common_methods_invocations.op_db`` is run, for
float32, float64 and int64 where the op supports them, on its first ``SAMPLES`` sample
inputs through ``torch.compile(fn, backend=lort.LortBackend(...), fullgraph=False)`` and
through eager PyTorch, and the forward outputs (and, for float dtypes of ops that support
backward, the gradients of the inputs) are compared with ``torch.testing.assert_close``;
then, for float dtypes, one of its samples filled with extreme values (signed zeros, inf,
NaN, overflow-scale magnitudes: ``conformance_extreme``), outputs only.

Each (op, dtype) gets one status:

* ``right``: every sample matched eager.
* ``fell back``: every sample matched eager, but lort warned that part of the graph
  "runs in PyTorch" (a group whose translation or ORT session failed): right, yet a
  failure the support check should have caught; listed by the sweep.
* ``wrong``: lort's outputs or gradients differ from eager's.
* ``crash``: compiling or running through lort raised.
* ``n/a``: not applicable, with the reason (eager itself raises on the sample, or eager's
  result is not reproducible: random ops).
* ``known difference``: every ordinary sample matched, and the extreme-value sample
  (``conformance_extreme``; float dtypes, outputs only) differs for a reason listed in
  its ``KNOWN_DIFFERENCES``. ``Result.failed_sample`` says which sample gave a wrong or
  crash status: ``ordinary`` or ``extreme``.
* ``xfail``: a known failure listed in ``XFAILS`` (with its reason) failed as expected;
  ``xpass`` when it did not fail.

It also records how many ATen nodes of the captured graphs ran in ORT and why the others
stayed in PyTorch (``fallback_kind`` labels each reason by its kind). Used by
``tests/ops/test_conformance.py`` (a fixed sample of ops) and ``python -m benchmarks conformance``
(every op, in worker processes: ``lort.testing.conformance_pool``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import conformance_extreme as extreme_values
from .conformance_fallbacks import FALLBACK_KINDS, KIND_LABELS, fallback_kind  # noqa: F401 - its API

#: The dtypes of the sweep, by name.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
#: Samples per op and dtype: the first ones ``op.sample_inputs`` gives.
SAMPLES = 2
#: assert_close tolerances (float64: torch.testing's own defaults for it).
TOLERANCES = {torch.float32: (1.3e-4, 1e-4), torch.float64: (1e-7, 1e-7)}
# Complex results (FFTs) compare as their float pairs do.
TOLERANCES.update({torch.complex64: TOLERANCES[torch.float32], torch.complex128: TOLERANCES[torch.float64]})
#: The backend options of the sweep: every group in ORT (no timing against PyTorch), one
#: ORT thread (no per-group thread timing), no disk cache (every graph translated anew).
BACKEND_OPTIONS = {"executor": "ort", "mode": "ort", "intra_op_num_threads": 1, "disk_cache": False}

#: Ops whose output is uninitialized memory: nothing to compare.
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"})

#: Expected failures: (OpInfo name, dtype name or None for every dtype) -> reason. The
#: fast test makes them strict xfails; the sweep reports them apart from new failures.
XFAILS: dict[tuple[str, str | None], str] = {
    ("topk", "int64"): (
        "ties: the int64 samples repeat values, and ORT's TopK returns other indices of equal "
        "values than PyTorch's (the values match; PyTorch does not specify the order of ties)"
    ),
}

STATUSES = ("right", "fell back", "wrong", "crash", "known difference", "n/a", "xfail", "xpass")


def op_id(op) -> str:
    """An OpInfo's name with its variant, e.g. 'nn.functional.pad.replicate'."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db() -> list:
    """PyTorch's OpInfo database (importing it takes seconds)."""
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def ops_by_id() -> dict:
    return {op_id(op): op for op in op_db()}


def family(op) -> str:
    """The op family a table groups ops by: a namespace (linalg, special, fft,
    nn.functional, ...) or, for torch.*, the OpInfo kind."""
    name = op.name
    if name.startswith("nn.functional."):
        return "nn.functional"
    if "." in name:
        return name.split(".")[0]
    kind = type(op).__name__
    return {
        "UnaryUfuncInfo": "unary elementwise",
        "BinaryUfuncInfo": "binary elementwise",
        "ReductionOpInfo": "reduction",
        "SpectralFuncInfo": "fft",
    }.get(kind, "other torch.*")


@dataclasses.dataclass
class Result:
    """The outcome of one op for one dtype."""

    op: str
    dtype: str
    status: str
    detail: str = ""
    family: str = ""
    samples: int = 0
    grads: bool = False
    ort_nodes: int = 0
    torch_nodes: int = 0
    #: (reason kind, ATen op) -> nodes that stayed in PyTorch for it.
    fallbacks: dict = dataclasses.field(default_factory=dict)
    #: An example reason per kind.
    reasons: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    #: Which sample gave a wrong or crash status: "ordinary" or "extreme".
    failed_sample: str = ""
    #: The extreme-value sample's outcome ("" when not run; "skipped: why").
    extreme: str = ""

    @property
    def ort_share(self) -> float | None:
        total = self.ort_nodes + self.torch_nodes
        return self.ort_nodes / total if total else None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["fallbacks"] = [[k, op, n] for (k, op), n in self.fallbacks.items()]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        d = dict(d)
        d["fallbacks"] = {(k, op): n for k, op, n in d["fallbacks"]}
        return cls(**d)


class _Mismatch(AssertionError):
    pass


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = " ".join(lines[:3]) if lines else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _clone(leaf):
    if isinstance(leaf, torch.Tensor):
        c = leaf.detach().clone()
        return c.requires_grad_(leaf.requires_grad)
    return leaf


class _Sample:
    """A sample input as a function of its tensors: the compiled function takes every
    tensor of the sample as an argument (not a constant), the rest is fixed."""

    def __init__(self, op, sample):
        self.op = op
        self.sample = sample
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.leaves = leaves
        self.tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def tensors(self) -> list[torch.Tensor]:
        return [_clone(self.leaves[i]) for i in self.tensor_idx]

    def fn(self):
        leaves, spec, idx, op = self.leaves, self.spec, self.tensor_idx, self.op.op

        def call(*tensors):
            filled = list(leaves)
            for i, t in zip(idx, tensors):
                filled[i] = t
            inp, args, kwargs = pytree.tree_unflatten(filled, spec)
            return op(inp, *args, **kwargs)

        return call

    def run(self, fn, with_grad: bool, seed: int):
        """Outputs of ``fn`` on fresh copies of the tensors and, with ``with_grad``, the
        gradients of the inputs that require grad (outputs weighted by fixed randoms)."""
        tensors = self.tensors()
        torch.manual_seed(seed)
        out = fn(*tensors)
        grads = None
        if with_grad:
            processed = self.sample.output_process_fn_grad(out)
            outs = [t for t in pytree.tree_leaves(processed) if isinstance(t, torch.Tensor) and t.requires_grad]
            wrt = [t for t in tensors if t.requires_grad]
            if outs and wrt:
                gen = torch.Generator().manual_seed(1234)
                cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
                grads = torch.autograd.grad(outs, wrt, cotangents, allow_unused=True)
        return out, grads


def _compare(what: str, got, expected, dtype) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    if len(got_leaves) != len(exp_leaves):
        raise _Mismatch(f"{what}: {len(got_leaves)} values, eager gives {len(exp_leaves)}")
    for i, (g, e) in enumerate(zip(got_leaves, exp_leaves)):
        where = f"{what} {i}" if len(exp_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise _Mismatch(f"{where}: {type(g).__name__}, eager gives a tensor")
            if g.shape != e.shape or g.dtype != e.dtype:
                raise _Mismatch(f"{where}: {g.dtype}{list(g.shape)}, eager gives {e.dtype}{list(e.shape)}")
            rtol, atol = TOLERANCES.get(e.dtype, (0.0, 0.0))
            try:
                torch.testing.assert_close(g.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as err:
                raise _Mismatch(f"{where}: {_mismatch_summary(g.detach(), e.detach(), err, rtol, atol)}") from None
        elif isinstance(e, float) and isinstance(g, float):
            if not (g == e or (math.isnan(g) and math.isnan(e))):
                raise _Mismatch(f"{where}: {g!r}, eager gives {e!r}")
        elif g != e:
            raise _Mismatch(f"{where}: {g!r}, eager gives {e!r}")


def _mismatch_summary(got: torch.Tensor, expected: torch.Tensor, err: AssertionError, rtol, atol) -> str:
    """assert_close's verdict and the element furthest out of tolerance: lort, eager."""
    first = str(err).strip().splitlines()[0]
    try:
        if expected.is_complex():
            got, expected = torch.view_as_real(got.resolve_conj()), torch.view_as_real(expected.resolve_conj())
        g, e = got.double().flatten(), expected.double().flatten()
        diff = (g - e).abs() / (atol + rtol * e.abs())
        diff = torch.where((g == e) | (torch.isnan(g) & torch.isnan(e)), torch.zeros_like(diff), diff)
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        k = int(diff.argmax())
        return f"{first} worst at flat index {k}: lort {g[k].item():.10g}, eager {e[k].item():.10g}"
    except Exception:  # noqa: BLE001 - the summary is best effort
        return first


def _lort_fallback_warnings(caught) -> list[str]:
    return sorted({str(w.message) for w in caught if "lort" in str(w.message) and "runs in PyTorch" in str(w.message)})


def run_op(op, dtype_name: str, samples: int = SAMPLES, options: dict | None = None,
           extreme: bool = True) -> Result:
    """Run one OpInfo for one dtype through lort and eager on its first ``samples``
    samples and, for float dtypes with ``extreme``, its extreme-value sample; classify."""
    start = time.perf_counter()
    dtype = DTYPES[dtype_name]
    name = op_id(op)
    result = Result(op=name, dtype=dtype_name, status="right", family=family(op))
    if dtype not in op.supported_dtypes("cpu"):
        result.status, result.detail = "n/a", f"op does not support {dtype_name} on CPU"
        return result
    if op.name in UNINITIALIZED:
        result.status, result.detail = "n/a", "the output is uninitialized memory"
        return result
    with_grad = (
        dtype.is_floating_point and op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
    )
    result.grads = with_grad and samples > 0
    extreme = extreme and dtype.is_floating_point
    torch.manual_seed(0)
    try:
        wanted = max(samples, extreme_values.CANDIDATES if extreme else 0)
        sample_list = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=with_grad), wanted))
    except Exception as e:  # noqa: BLE001 - PyTorch's own sample generator
        result.status, result.detail = "n/a", f"sample_inputs raises: {_first_line(e)}"
        return result
    if not sample_list:
        result.status, result.detail = "n/a", "no sample inputs"
        return result
    fell_back: list[str] = []
    for k, raw in enumerate(sample_list[:samples]):
        outcome = _check_sample(_Sample(op, raw), k, with_grad, result, options, fell_back)
        if outcome is not None:
            (result.status, result.detail), result.failed_sample = outcome, "ordinary"
            break
        result.samples += 1
    if extreme and result.status == "right":
        _check_extreme(op, sample_list, result, options, fell_back)
    if result.status == "right" and fell_back:
        result.status, result.detail = "fell back", " | ".join(fell_back)[:600]
    expected_failure = XFAILS.get((name, dtype_name)) or XFAILS.get((name, None))
    if expected_failure:
        if result.status in ("wrong", "crash"):
            result.status, result.detail = "xfail", f"{expected_failure} [{result.status}: {result.detail}]"
        elif result.status in ("right", "fell back"):
            result.status, result.detail = "xpass", f"listed in XFAILS: {expected_failure}"
    result.seconds = time.perf_counter() - start
    return result


def _check_extreme(op, sample_list: list, result: Result, options, fell_back: list) -> None:
    """The extreme-value sample (lort.testing.conformance_extreme): outputs only. Eager
    raising or not reproducible on it skips it; a known difference is its own status."""
    if op_id(op) in extreme_values.EAGER_CRASHES:
        result.extreme = f"skipped: {extreme_values.EAGER_CRASHES[op_id(op)]}"
        return
    samples = [_Sample(op, raw) for raw in sample_list]
    chosen = extreme_values.pick([s.leaves for s in samples])
    if chosen is None:
        result.extreme = "skipped: no floating tensor"
        return
    sample = samples[chosen]
    sample.leaves = extreme_values.fill(sample.leaves)
    eager_fn = None
    if op_id(op) in extreme_values.PER_ELEMENT_REFERENCE:
        eager_fn = extreme_values.per_element(sample.fn())
    outcome = _check_sample(sample, f"extreme (from sample {chosen})", False, result, options, fell_back, eager_fn)
    if outcome is None:
        result.extreme = "right"
    elif outcome[0] == "n/a":
        result.extreme = f"skipped: {outcome[1]}"
    else:
        known = extreme_values.known_difference(result.op, result.dtype)
        (result.status, result.detail), result.failed_sample = outcome, "extreme"
        if known and outcome[0] == "wrong":
            result.status, result.detail = "known difference", f"{known} [{result.detail}]"
        result.extreme = result.status


def _check_sample(sample: _Sample, k, with_grad: bool, result: Result, options, fell_back: list, eager_fn=None):
    """One sample through eager (twice; ``eager_fn`` in place of the op where given) and
    lort: None when lort matched eager, else (status, detail). ``k`` names the sample
    (and seeds it)."""
    from ..backend import LortBackend

    dtype, fn = DTYPES[result.dtype], sample.fn()
    seed = k if isinstance(k, int) else 99
    try:
        expected, exp_grads = sample.run(eager_fn or fn, with_grad, seed=seed)
        again, again_grads = sample.run(eager_fn or fn, with_grad, seed=seed + 1000)
    except Exception as e:  # noqa: BLE001 - eager PyTorch's own failure
        return "n/a", f"eager raises on sample {k}: {_first_line(e)}"
    try:
        _compare("output", again, expected, dtype)
        _compare("grad", again_grads, exp_grads, dtype)
    except _Mismatch:
        return "n/a", "nondeterministic (two eager runs differ)"
    backend = LortBackend({**BACKEND_OPTIONS, **(options or {})})
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, got_grads = sample.run(compiled, with_grad, seed=seed)
        fell_back += _lort_fallback_warnings(caught)
    except Exception as e:  # noqa: BLE001 - what the sweep records
        return "crash", f"sample {k}: {_first_line(e)}"
    finally:
        _count_nodes(result, backend)
        torch._dynamo.reset()
    try:
        _compare("output", got, expected, dtype)
        _compare("grad", got_grads, exp_grads, dtype)
    except _Mismatch as e:
        return "wrong", f"sample {k} ({_describe(sample)}): {e}"
    return None


def _count_nodes(result: Result, backend) -> None:
    for record in backend.records:
        result.ort_nodes += record.ort_nodes
        result.torch_nodes += record.torch_nodes
        for op, reason in record.fallbacks:
            kind = fallback_kind(reason)
            key = (kind, op)
            result.fallbacks[key] = result.fallbacks.get(key, 0) + 1
            result.reasons.setdefault(kind, f"{op}: {reason}"[:300])


def _describe(sample: _Sample) -> str:
    """A short description of a sample: tensor shapes and dtypes, other arguments."""
    inp, args, kwargs = pytree.tree_unflatten(sample.leaves, sample.spec)

    def short(x):
        if isinstance(x, torch.Tensor):
            if x.numel() <= 4:
                return f"tensor({x.detach().tolist()}, {str(x.dtype).replace('torch.', '')})"
            return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        return repr(x)

    parts = [short(x) for x in pytree.tree_leaves(inp)]
    parts += [str(pytree.tree_map(short, a)) for a in args]
    parts += [f"{k}={pytree.tree_map(short, v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 200 else text[:197] + "..."


def totals(results: list[Result]) -> dict[str, collections.Counter]:
    """Status counts per dtype."""
    out: dict[str, collections.Counter] = {d: collections.Counter() for d in DTYPES}
    for r in results:
        out[r.dtype][r.status] += 1
    return out


def mean_ort_share(results: list[Result]) -> float | None:
    """Mean over (op, dtype) results that captured ATen nodes of their share in ORT."""
    shares = [r.ort_share for r in results if r.ort_share is not None]
    return sum(shares) / len(shares) if shares else None


def mean_ort_share_without_views(results: list[Result]) -> float | None:
    """``mean_ort_share`` with the nodes the fuser leaves to PyTorch as views only (by
    design: a view in ORT is a copy, with no compute to gain) counted on neither side;
    results left with no node do not count."""
    shares = []
    for r in results:
        views = sum(n for (kind, _), n in r.fallbacks.items() if kind == "views only")
        total = r.ort_nodes + r.torch_nodes - views
        if total > 0:
            shares.append(r.ort_nodes / total)
    return sum(shares) / len(shares) if shares else None
