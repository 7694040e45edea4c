"""ATen's orthogonal polynomials as ONNX, matching PyTorch's CPU kernels.

torch_lib translates none of special_chebyshev_polynomial_{t,u,v,w}, their shifted
forms, special_hermite_polynomial_{h,he}, special_laguerre_polynomial_l and
special_legendre_polynomial_p. Eager runs ATen/native/Math.h per element: x and n in the
result dtype (integers promote to the default float), n cast to int64 (on x86 NaN, inf
and |n| >= 2**63 become INT64_MIN, so negative), special cases (n < 0, |x| == 1, n == 0
or 1, closed cos/acos forms, Hermite's NaN above degree 128 / 512), else a three-term
recurrence run while ``k <= n`` (most also stop once q is NaN). Here the recurrence is
one ONNX ``Loop`` over the whole tensor: its trip count is the most steps any element
needs, computed at run time; a per-element mask keeps the elements that are done, and
the loop stops when none is left (so a NaN stop ends it as early as eager). The special
cases follow by Where, in the kernel's order.

Exactness against eager on an AVX2/AVX512 CPU (float32 bit-for-bit where ONNX can
write the kernel's own operations):

- eager's recurrence is compiled with FMA contraction, ``a*q - b*p`` as
  fma(a, q, -(b*p)). float32 emulates it in float64 (exact but for double rounding);
  float64 rounds a*q, as ONNX has no FMA: a few ulp.
- acos is fdlibm's, which glibc's acosf is, written out op by op: bit-exact in
  float32; float64 (ORT's CPU has no float64 Acos) is within 1 ulp of glibc's acos.
- cos and sin of float32 arguments are computed in float64 and rounded: within 1 ulp
  of glibc's cosf and sinf.
- where eager returns an uninitialized variable (a NaN x entering the recurrence of U,
  V, W, all four shifted forms, Laguerre or Legendre: whatever the register held, -inf,
  0 or a denormal), the result is NaN.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import torch
import torch.fx

aten = torch.ops.aten
F32, F64, I64, BOOL = ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT64, ir.DataType.BOOL
_BODIES = itertools.count()
#: The degree above which eager's Hermite polynomials are NaN (getHermitianLimit).
_HERMITE_LIMIT = {F32: 128, F64: 512}


class _Ops:
    """ONNX ops by name (``o.Add(a, b)``) of one result dtype, recorded by onnxscript's
    tracer (the translation's own nodes) or on an onnx_ir tape (a Loop body)."""

    def __init__(self, dtype: ir.DataType, tape: ir.tape.Tape | None = None):
        self.dtype, self.tape, self._constants = dtype, tape, {}

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def emit(*inputs, **attributes):
            if self.tape is not None:
                return self.tape.op(op_type, list(inputs), attributes=attributes or None)
            from onnxscript import opset18

            return getattr(opset18, op_type)(*inputs, **attributes)

        return emit

    def c(self, value, dtype: ir.DataType | None = None) -> ir.Value:
        """A constant of ``dtype`` (the result dtype by default); an integer is converted
        from int64, as eager converts an integer scalar."""
        np_dtype = (dtype or self.dtype).numpy()
        array = np.array(value, dtype=np.int64 if isinstance(value, int) else None).astype(np_dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.Constant(value=ir.tensor(array))
        return self._constants[key]

    def t(self, value: ir.Value) -> ir.Value:
        """``value`` (an int64 or bool tensor) converted to the result dtype."""
        return self.Cast(value, to=self.dtype)

    def trig(self, name: str, value: ir.Value) -> ir.Value:
        """Cos or Sin; of float32 in float64, rounded (within 1 ulp of glibc's cosf/sinf)."""
        if self.dtype != F32:
            return getattr(self, name)(value)
        return self.Cast(getattr(self, name)(self.Cast(value, to=F64)), to=F32)

    def reflected(self, name: str, v: ir.Value) -> ir.Value:
        """Sin(v) for v in [0, pi], Cos(v) for v in [0, pi/2]; in float64 near the upper
        end as the sine of the distance to pi (pi/2), taken in full precision: ORT's
        float64 Sin and Cos there are off by an ulp of 1, not of the result."""
        if self.dtype == F32:
            return self.trig(name, v)
        end, end_lo = (np.pi, 1.2246467991473532e-16) if name == "Sin" else _ACOS[F64][4:6]
        distance = self.Add(self.Sub(self.c(end), v), self.c(end_lo))
        return self.Where(self.Greater(v, self.c(end / 2)), self.Sin(distance), getattr(self, name)(v))

    def rounds_to_one(self, h: ir.Value, near_half_pi: bool = False) -> ir.Value:
        """Whether libm's cos(h) (sin(h) for h near pi/2) rounds to exactly 1: the kernels
        test it, and ORT's float64 Cos and Sin are not correctly rounded there. With d the
        distance from 0 (from pi/2), 1 - d*d/2 rounds to 1 (a tie to 1) iff d*d <= 2 ulp(1)/2;
        d*d is exact (float32's in float64) or within rounding at the boundary."""
        if self.dtype == F32:
            h = self.Cast(h, to=F64)
            d = self.Sub(self.c(np.pi / 2, F64), h) if near_half_pi else h
            return self.LessOrEqual(self.Mul(d, d), self.c(2.0**-24, F64))
        pio2_hi, pio2_lo = _ACOS[F64][4:6]
        d = self.Add(self.Sub(self.c(pio2_hi), h), self.c(pio2_lo)) if near_half_pi else h
        return self.LessOrEqual(self.Mul(d, d), self.c(2.0**-53))

    def fms(self, a: ir.Value, q: ir.Value, b: ir.Value) -> ir.Value:
        """``a*q - b`` as eager's FMA contraction computes it: a*q not rounded (float32
        in float64; float64 rounds it)."""
        if self.dtype != F32:
            return self.Sub(self.Mul(a, q), b)
        a, q, b = (self.Cast(v, to=F64) for v in (a, q, b))
        return self.Cast(self.Sub(self.Mul(a, q), b), to=F32)


# fdlibm's e_acosf.c (glibc's acosf) and e_acos.c: precision, the leading bits its
# ``df`` keeps, |x| below which acos is pi/2, pi, pio2_hi, pio2_lo, pS0..pS5, qS1..qS4.
_ACOS = {
    F32: (24, 12, 2.0**-57 * (1 + 2.0**-23), 3.1415925026e00, 1.5707962513e00, 7.5497894159e-08,
          (1.6666667163e-01, -3.2556581497e-01, 2.0121252537e-01, -4.0055535734e-02, 7.9153501429e-04,
           3.4793309169e-05),
          (-2.4033949375e00, 2.0209457874e00, -6.8828397989e-01, 7.7038154006e-02)),
    F64: (53, 21, 2.0**-57 * (1 + 2.0**-20), 3.14159265358979311600e00, 1.57079632679489655800e00,
          6.12323399573676603587e-17,
          (1.66666666666666657415e-01, -3.25565818622400915405e-01, 2.01212532134862925881e-01,
           -4.00555345006794114027e-02, 7.91534994289814532176e-04, 3.47933107596021167570e-05),
          (-2.40339491173441421878e00, 2.02094576023350569471e00, -6.88283971605453293030e-01,
           7.70381505559019352791e-02)),
}


def _acos(o: _Ops, x: ir.Value) -> ir.Value:
    """acos(x) for |x| < 1, fdlibm's operations in fdlibm's order."""
    precision, keep, tiny, pi, pio2_hi, pio2_lo, ps, qs = _ACOS[o.dtype]
    one, half, two = o.c(1.0), o.c(0.5), o.c(2.0)

    def ratio(z):  # fdlibm's r = p/q
        p = o.c(ps[-1])
        for a in reversed(ps[:-1]):
            p = o.Add(o.c(a), o.Mul(z, p))
        q = o.c(qs[-1])
        for a in reversed(qs[:-1]):
            q = o.Add(o.c(a), o.Mul(z, q))
        return o.Div(o.Mul(z, p), o.Add(one, o.Mul(z, q)))

    small = o.Sub(o.c(pio2_hi), o.Sub(x, o.Sub(o.c(pio2_lo), o.Mul(x, ratio(o.Mul(x, x))))))
    z = o.Mul(o.Add(one, x), half)
    s = o.Sqrt(z)
    negative = o.Sub(o.c(pi), o.Mul(two, o.Add(s, o.Sub(o.Mul(ratio(z), s), o.c(pio2_lo)))))
    z = o.Mul(o.Sub(one, x), half)
    s = o.Sqrt(z)
    # df: s with all but its leading ``keep`` bits cleared (fdlibm masks the word). The
    # power of two under s is s rounded to one bit (Veltkamp's split), halved if it rounded up.
    t = o.Mul(s, o.c(2.0 ** (precision - 1) + 1))
    top = o.Sub(t, o.Sub(t, s))
    unit = o.Mul(o.Where(o.Greater(top, s), o.Mul(top, half), top), o.c(2.0 ** (1 - keep)))
    df = o.Mul(o.Floor(o.Div(s, unit)), unit)
    c = o.Div(o.Sub(z, o.Mul(df, df)), o.Add(s, df))
    positive = o.Mul(two, o.Add(df, o.Add(o.Mul(ratio(z), s), c)))
    ax = o.Abs(x)
    small = o.Where(o.Less(ax, o.c(tiny)), o.Add(o.c(pio2_hi), o.c(pio2_lo)), small)
    return o.Where(o.Less(ax, half), small, o.Where(o.Less(x, o.c(0.0)), negative, positive))


class _Terms:
    """x and n broadcast to one shape, n as the kernel's int64, and what the kernels
    derive from them (``T(v)``: an int64 converted to the result dtype)."""

    def __init__(self, o: _Ops, x: ir.Value, n: ir.Value):
        self.o = o
        self.x = o.Expand(x, o.Shape(n))
        n = o.Expand(n, o.Shape(x))
        # static_cast<int64_t>(n) on x86: NaN, inf and |n| >= 2**63 give INT64_MIN.
        self.n = o.Cast(o.Where(o.Less(o.Abs(n), o.c(2.0**63)), n, o.c(-1.0)), to=I64)
        self.even = o.Equal(o.Mod(self.n, o.c(2, I64)), o.c(0, I64))

    def negative(self) -> ir.Value:
        return self.o.Less(self.n, self.o.c(0, I64))

    def n_is(self, k: int) -> ir.Value:
        return self.o.Equal(self.n, self.o.c(k, I64))

    def n_above(self, k: int) -> ir.Value:
        return self.o.Greater(self.n, self.o.c(k, I64))

    def n_plus(self, k: int, times: int = 1) -> ir.Value:
        """T(times * n + k)."""
        o, n = self.o, self.n
        return o.t(o.Add(o.Mul(n, o.c(times, I64)) if times != 1 else n, o.c(k, I64)))

    def signed(self, value: ir.Value) -> ir.Value:
        """value for an even n, -value for an odd one."""
        return self.o.Where(self.even, value, self.o.Neg(value))


def _recurrence(o: _Ops, q0: ir.Value, steps: ir.Value, step, nan_stop: bool) -> ir.Value:
    """q after each element's own ``steps`` of ``p, q = q, step(body_ops, p, q, i)``
    (i counts from 0; p starts at 1), stopping an element at NaN q if ``nan_stop``."""
    flat = o.Reshape(steps, o.c([-1], I64))
    trips = o.ReduceMax(o.Concat(o.c([0], I64), flat, axis=0), keepdims=0)
    b = _Ops(o.dtype, ir.tape.Tape())
    prefix = f"lort_poly{next(_BODIES)}"
    scalar = ir.Shape([])
    i = ir.Value(name=f"{prefix}_i", type=ir.TensorType(I64), shape=scalar)
    cond = ir.Value(name=f"{prefix}_cond", type=ir.TensorType(BOOL), shape=scalar)
    p = ir.Value(name=f"{prefix}_p", type=ir.TensorType(o.dtype))
    q = ir.Value(name=f"{prefix}_q", type=ir.TensorType(o.dtype))
    active = b.Less(i, steps)
    if nan_stop:
        active = b.And(active, b.Not(b.IsNaN(q)))
    r = step(b, p, q, i)
    more = b.Cast(b.ReduceMax(b.Cast(active, to=I64), keepdims=0), to=BOOL)
    outputs = [more, b.Where(active, r, q), b.Where(active, q, p)]
    # Names of their own: a subgraph may not reuse a name of the graph around it.
    for k, node in enumerate(b.tape.nodes):
        for value in node.outputs:
            value.name = f"{prefix}_{k}_{value.index()}"
    body = ir.Graph([i, cond, q, p], outputs, nodes=b.tape.nodes, name=f"{prefix}_body")
    start = o.c(True, BOOL)
    # p starts at 1 of q's shape; a Where of q, so that no constant of that size is folded.
    p0 = o.Where(o.IsNaN(q0), o.c(1.0), o.c(1.0))
    result = o.Loop(trips, start, q0, p0, body=body)
    # torch.onnx's recorder gives Loop's variadic input every positional argument and
    # Loop one output (its schema's count); ORT wants one output per carried value.
    node = result.producer()
    wanted = [trips, start, q0, p0]
    node.resize_inputs(len(wanted))
    for k, value in enumerate(wanted):
        node.replace_input_with(k, value)
    node.resize_outputs(2)
    return result


def _chebyshev(kind: str, shifted: bool):
    """Chebyshev's T, U, V or W (shifted: of 2x - 1): the kernels share their shape."""
    threshold = 6 if shifted else {"t": 6, "u": 8, "v": 8, "w": 8}[kind]
    if shifted and kind == "w":
        threshold = 4

    def build(o: _Ops, t: _Terms):
        x, one = t.x, o.c(1.0)
        z = o.Sub(o.Add(x, x), one) if shifted else x
        two_z = o.Add(z, z)
        n1, n21 = (t.n_plus(1), t.n_plus(1, 2)) if kind != "t" else (None, None)
        # The values at z = 1 and z = -1 (shifted: at x == 1 and x == 0).
        at_one = {"t": one, "u": n1, "v": one, "w": n21}[kind]
        at_minus_one = t.signed({"t": one, "u": n1, "v": n21, "w": one}[kind])
        if shifted:
            ends = [(o.Equal(x, one), at_one), (o.Equal(x, o.c(0.0)), at_minus_one)]
        else:
            plus = o.Greater(x, o.c(0.0))
            ends = [(o.Equal(o.Abs(x), one), o.Where(plus, at_one, at_minus_one))]
        a = _acos(o, z)
        half_a = o.Div(a, o.c(2.0))
        n_half = o.Add(o.t(t.n), o.c(0.5))
        if kind == "t":
            closed = o.trig("Cos", o.Mul(o.t(t.n), a))
        elif kind == "u":
            sin_a = o.reflected("Sin", a)
            by_sin = o.Div(o.trig("Sin", o.Mul(n1, a)), sin_a)
            by_z = o.Div(o.Mul(n1, o.trig("Cos", o.Mul(n1, a))), z)
            closed = o.Where(o.Equal(sin_a, o.c(0.0)), by_z, by_sin)
        elif kind == "v":
            ratio = o.Div(o.trig("Cos", o.Mul(n_half, a)), o.reflected("Cos", half_a))
            closed = o.Where(o.rounds_to_one(half_a, near_half_pi=True), at_minus_one, ratio)
        else:
            ratio = o.Div(o.trig("Sin", o.Mul(n_half, a)), o.trig("Sin", half_a))
            edge = at_minus_one if shifted else o.Where(plus, at_one, at_minus_one)
            closed = o.Where(o.rounds_to_one(half_a), edge, ratio)
        q0 = {"t": z, "u": two_z, "v": o.Sub(two_z, one), "w": o.Add(two_z, one)}[kind]
        cases = [(t.negative(), o.c(0.0)), *ends,
                 (o.And(t.n_above(threshold), o.Less(o.Abs(z), one)), closed),
                 (t.n_is(0), one), (t.n_is(1), q0)]
        return cases, q0, (lambda b, p, q, i: b.fms(two_z, q, p)), True

    return build


def _hermite(physicists: bool):
    """Hermite's H (physicists') or He (probabilists')."""

    def build(o: _Ops, t: _Terms):
        x = t.x
        q0 = o.Add(x, x) if physicists else x

        def step(b, p, q, i):
            k = b.Add(i, b.c(1, I64))
            k = b.Mul(k, b.c(2, I64)) if physicists else k
            return b.fms(q0, q, b.Mul(b.t(k), p))

        limit = t.n_above(_HERMITE_LIMIT[o.dtype])
        cases = [(t.negative(), o.c(0.0)), (t.n_is(0), o.c(1.0)), (t.n_is(1), q0),
                 (limit, o.c(float("nan")))]
        return cases, q0, step, False

    return build


def _laguerre(o: _Ops, t: _Terms):
    x, one = t.x, o.c(1.0)
    q0 = o.Sub(one, x)

    def step(b, p, q, i):
        k = b.Add(i, b.c(1, I64))
        a = b.Add(b.t(b.Add(k, k)), q0)
        return b.Div(b.fms(a, q, b.Mul(b.t(k), p)), b.t(b.Add(k, b.c(1, I64))))

    cases = [(t.negative(), o.c(0.0)), (o.Equal(x, o.c(0.0)), one), (t.n_is(0), one),
             (t.n_is(1), q0)]
    return cases, q0, step, True


def _legendre(o: _Ops, t: _Terms):
    x, one = t.x, o.c(1.0)

    def step(b, p, q, i):
        k = b.Add(i, b.c(1, I64))
        a = b.Mul(b.t(b.Add(b.Add(k, k), b.c(1, I64))), x)
        return b.Div(b.fms(a, q, b.Mul(b.t(k), p)), b.t(b.Add(k, b.c(1, I64))))

    ends = o.Where(o.Or(o.Greater(x, o.c(0.0)), t.even), one, o.c(-1.0))
    cases = [(t.negative(), o.c(0.0)), (o.Equal(o.Abs(x), one), ends), (t.n_is(0), one),
             (t.n_is(1), x)]
    return cases, x, step, True


_BUILDERS = {
    **{f"special_chebyshev_polynomial_{k}": _chebyshev(k, False) for k in "tuvw"},
    **{f"special_shifted_chebyshev_polynomial_{k}": _chebyshev(k, True) for k in "tuvw"},
    "special_hermite_polynomial_h": _hermite(True),
    "special_hermite_polynomial_he": _hermite(False),
    "special_laguerre_polynomial_l": _laguerre,
    "special_legendre_polynomial_p": _legendre,
}

_FLOAT_DTYPES = {torch.float32: F32, torch.float64: F64}


def _result_dtype(x, n) -> ir.DataType:
    """Eager's result dtype: x and n promoted (a scalar, a 0-d tensor by category),
    integers to the default float dtype."""

    def proxy(value):
        if isinstance(value, _Scalar):
            return 0.0 if value.value.dtype.is_floating_point() else 0
        if not isinstance(value, ir.Value):
            return value
        if value.shape is None:
            raise ValueError("an input of unknown rank")
        dtype = torch.from_numpy(np.zeros(0, dtype=value.dtype.numpy())).dtype
        return torch.zeros((1,) * min(len(value.shape), 1), dtype=dtype)

    dtype = torch.result_type(proxy(x), proxy(n))
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise NotImplementedError(f"lort translates the orthogonal polynomials for float32 and float64, not {dtype}")
    return _FLOAT_DTYPES[dtype]


class _Scalar:
    """A Scalar argument that is a graph value (a symbolic number)."""

    def __init__(self, value: ir.Value):
        self.value = value


def _check_device(*values) -> None:
    """Refuse (the node then stays in PyTorch) inputs on a device other than the CPU:
    CUDA's kernels (ATen/native/cuda/Math.cuh) cast a NaN or infinite n to 0 or
    INT64_MAX, and use CUDA's own acos, cos and sin. The exporter records the FX node
    behind a graph input on the value, and behind a computed value on its producer."""
    for value in values:
        if not isinstance(value, ir.Value):
            continue
        producer = value.producer()
        node = value.meta.get("node") or (producer.meta.get("node") if producer is not None else None)
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        val = val[value.index() or 0] if isinstance(val, (tuple, list)) else val
        if isinstance(val, torch.Tensor) and val.device.type != "cpu":
            raise NotImplementedError(f"lort's orthogonal polynomials follow the CPU kernels, not {val.device}'s")


def _translate(build, x, n) -> ir.Value:
    _check_device(x.value if isinstance(x, _Scalar) else x, n.value if isinstance(n, _Scalar) else n)
    o = _Ops(_result_dtype(x, n))

    def converted(v):
        v = v.value if isinstance(v, _Scalar) else v
        if not isinstance(v, ir.Value):
            return o.c(v)
        return v if v.dtype == o.dtype else o.t(v)

    t = _Terms(o, converted(x), converted(n))
    cases, q0, step, nan_stop = build(o, t)
    taken = cases[0][0]
    for cond, _ in cases[1:]:
        taken = o.Or(taken, cond)
    steps = o.Where(taken, o.c(0, I64), o.Sub(t.n, o.c(1, I64)))
    result = _recurrence(o, q0, steps, step, nan_stop)
    for cond, value in reversed(cases):
        result = o.Where(cond, value, result)
    return result


def _overloads(name: str, build) -> dict:
    """The translations of the op's default, x_scalar and n_scalar overloads."""

    def scalar(v):
        return _Scalar(v) if isinstance(v, ir.Value) else v

    def default(x, n):
        return _translate(build, x, n)

    def x_scalar(x, n):
        return _translate(build, scalar(x), n)

    def n_scalar(x, n):
        return _translate(build, x, scalar(n))

    functions = {"default": default, "x_scalar": x_scalar, "n_scalar": n_scalar}
    for overload, fn in functions.items():
        fn.__name__ = fn.__qualname__ = f"lort_{name}_{overload}"
    return functions


def register(registry) -> None:
    """Put the translations of the orthogonal polynomials into ``registry``."""
    from onnxscript import opset18
    from onnxscript.values import TracedOnnxFunction

    for name, build in _BUILDERS.items():
        packet = getattr(aten, name)
        for overload, fn in _overloads(name, build).items():
            registry.register_op(getattr(packet, overload), TracedOnnxFunction(opset18, fn))
