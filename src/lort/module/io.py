"""The one set of flatten/unflatten primitives of ORTModule (seed 002: one implementation
shared by input construction and output restoration, so every structure is supported
the same way everywhere).

``flatten(obj)`` returns ``(tensors, spec)``: the tensors in a fixed order, and a spec
that holds everything else (the structure, and every non-tensor leaf as a constant).
``unflatten(spec, tensors)`` rebuilds an equal object. A spec is made of plain tuples,
strings, Python constants and classes only, so it is hashable (a cache key), can be
compared, and Dynamo can trace both functions and return a spec from a compiled graph.

Spec nodes (first element is the kind):

    ("tensor",)                              a tensor leaf
    ("const", type, value)                   None, bool, int, float, complex, str, bytes,
                                             torch.dtype, torch.device, ... (hashable)
    ("list", (child, ...))
    ("tuple", (child, ...))
    ("namedtuple", cls, (child, ...))
    ("dict", cls, (key, ...), (child, ...))  dict, OrderedDict and other dict subclasses
    ("dataclass", cls, (field, ...), (child, ...), (non-init field, ...))
    ("model_output", cls, (key, ...), (child, ...))   transformers' ModelOutput
    ("object", cls)                          an input object that holds state (a Hugging
                                             Face DynamicCache): with ``objects`` (a list),
                                             flatten appends it there and unflatten takes it
                                             back, so a schema depends on its class only,
                                             never on which object it is
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator

import torch

from ..errors import UnsupportedInputError

#: Types kept as constants in a spec (hashable, compared by value).
_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                   torch.memory_format, type(Ellipsis), slice, range)


def _model_output_class():
    """transformers' ModelOutput if transformers is imported (no object can be one otherwise)."""
    mod = sys.modules.get("transformers.utils.generic")
    return getattr(mod, "ModelOutput", None) if mod is not None else None


def flatten(obj: Any, paths: list[str] | None = None, path: str = "") -> tuple[list[torch.Tensor], tuple]:
    """The tensors of ``obj`` in order and the spec of everything else.

    With ``paths`` (a list), the path of each tensor leaf (e.g. ``input_ids``,
    ``x[0]['a']``) is appended to it, in the order of the tensors."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(obj, tensors, path if paths is not None else None, paths, None)
    return tensors, spec


def flatten_call(args: tuple, kwargs: dict, arg_names: list[str], paths: list[str] | None = None,
                 objects: list | None = None) -> tuple[list[torch.Tensor], tuple]:
    """``flatten((args, kwargs))`` where positional argument i is named ``arg_names[i]``
    in paths (the parameter names of ``forward``) and keyword arguments by their key.
    With ``objects`` (a list), an object that holds state (``_by_reference``) is appended
    to it and is an ``("object", cls)`` leaf (else a constant: the same object or a new
    schema)."""
    if paths is None and not kwargs and all(map(is_tensor, args)):
        # The common call, tensors only: its spec without walking (the same as below).
        return list(args), tensor_call_spec(len(args))
    tensors: list[torch.Tensor] = []
    track = paths is not None
    a = tuple(
        _flatten(v, tensors, (arg_names[i] if i < len(arg_names) else f"args[{i}]") if track else None, paths,
                 objects)
        for i, v in enumerate(args)
    )
    k = _flatten(kwargs, tensors, "" if track else None, paths, objects)
    return tensors, ("tuple", (("tuple", a), k))


_TENSOR_CALLS: dict[int, tuple] = {}


def is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def tensor_call_spec(n: int) -> tuple:
    """The spec of a call of ``n`` positional tensors (one object per ``n``)."""
    spec = _TENSOR_CALLS.get(n)
    if spec is None:
        spec = _TENSOR_CALLS[n] = ("tuple", (("tuple", (("tensor",),) * n), ("dict", dict, (), ())))
    return spec


def opaque_constant(spec: tuple) -> type | None:
    """The type of the first leaf of ``spec`` that is no plain constant (an object kept
    as it was, which may hold tensors: a Hugging Face DynamicCache), or None."""
    kind = spec[0]
    if kind == "object":
        return spec[1]
    if kind == "const":
        return None if isinstance(spec[2], _CONSTANT_TYPES) else spec[1]
    if kind == "tensor":
        return None
    children = spec[1] if kind in ("tuple", "list") else spec[2] if kind == "namedtuple" else spec[3]
    for child in children:
        found = opaque_constant(child)
        if found is not None:
            return found
    return None


def arg_paths(spec: tuple, arg_names: list[str]) -> list[str]:
    """The path of each tensor leaf of a ``flatten_call`` spec."""
    return [p for p, leaf in _leaves(spec, arg_names) if leaf[0] == "tensor"]


def string_paths(spec: tuple, arg_names: list[str]) -> list[tuple[str, object]]:
    """(path, value) of each str or bytes leaf of a ``flatten_call`` spec."""
    return [(p, leaf[2]) for p, leaf in _leaves(spec, arg_names) if leaf[0] == "const" and leaf[1] in (str, bytes)]


def _leaves(spec: tuple, arg_names: list[str]) -> list[tuple[str, tuple]]:
    out: list = []
    _walk_paths(spec[1][0], "", out, arg_names)
    _walk_paths(spec[1][1], "", out, None)
    return out


def _walk_paths(spec, path, out, arg_names):
    kind = spec[0]
    if kind in ("tensor", "const"):
        out.append((path, spec))
    elif kind in ("list", "tuple"):
        for i, c in enumerate(spec[1]):
            if arg_names is not None:
                _walk_paths(c, arg_names[i] if i < len(arg_names) else f"args[{i}]", out, None)
            else:
                _walk_paths(c, f"{path}[{i}]", out, None)
    elif kind == "namedtuple":
        for f, c in zip(spec[1]._fields, spec[2]):
            _walk_paths(c, f"{path}.{f}", out, None)
    elif kind in ("dict", "model_output"):
        for k, c in zip(spec[2], spec[3]):
            _walk_paths(c, _key_path(path, k) if kind == "dict" else f"{path}.{k}", out, None)
    elif kind == "dataclass":
        for n, c in zip(spec[2] + spec[4], spec[3]):
            _walk_paths(c, f"{path}.{n}", out, None)


def diff_call(old: tuple, new: tuple, arg_names: list[str]) -> list[str]:
    """Where two ``flatten_call`` specs differ in structure or constants, as phrases
    naming the argument (``input 'labels' passed (was omitted)``, ``input 'n' value
    changed 2 -> 3``)."""
    out: list[str] = []
    a_old, a_new = old[1][0][1], new[1][0][1]
    for i in range(max(len(a_old), len(a_new))):
        name = arg_names[i] if i < len(arg_names) else f"args[{i}]"
        if i >= len(a_old):
            out.append(f"{_name(name)} passed positionally (was omitted)")
        elif i >= len(a_new):
            out.append(f"{_name(name)} omitted (was passed positionally)")
        else:
            _diff(a_old[i], a_new[i], name, out)
    _diff(old[1][1], new[1][1], "", out)
    return out


def _flatten(obj, tensors, path, paths, objects):
    # ``path`` is None when paths are not tracked (the common, fast case).
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        if paths is not None:
            paths.append(path)
        return ("tensor",)
    if isinstance(obj, _CONSTANT_TYPES):
        return ("const", type(obj), obj)
    mo = _model_output_class()
    if mo is not None and isinstance(obj, mo):
        keys = tuple(obj.keys())
        children = tuple(_flatten(obj[k], tensors, _sub(path, "." + k), paths, objects) for k in keys)
        return ("model_output", type(obj), keys, children)
    if isinstance(obj, tuple):
        if hasattr(type(obj), "_fields"):
            fields = type(obj)._fields
            children = tuple(_flatten(v, tensors, _sub(path, "." + f), paths, objects) for f, v in zip(fields, obj))
            return ("namedtuple", type(obj), children)
        children = tuple(_flatten(v, tensors, _sub(path, f"[{i}]"), paths, objects) for i, v in enumerate(obj))
        return ("tuple", children)
    if isinstance(obj, list):
        children = tuple(_flatten(v, tensors, _sub(path, f"[{i}]"), paths, objects) for i, v in enumerate(obj))
        return ("list", children)
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        for k in keys:
            if not isinstance(k, _CONSTANT_TYPES):
                raise UnsupportedInputError(
                    f"lort.ORTModule: dict key {k!r} at {path or 'top level'} has type {type(k).__name__}; "
                    "dict keys must be strings, numbers or other constants"
                )
        children = tuple(
            _flatten(obj[k], tensors, None if path is None else _key_path(path, k), paths, objects) for k in keys
        )
        return ("dict", type(obj), keys, children)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        init = tuple(f.name for f in fields if f.init)
        rest = tuple(f.name for f in fields if not f.init)
        children = tuple(_flatten(getattr(obj, f), tensors, _sub(path, "." + f), paths, objects) for f in init + rest)
        return ("dataclass", type(obj), init, children, rest)
    if objects is not None and _by_reference(obj):
        objects.append(obj)
        return ("object", type(obj))
    try:
        hash(obj)
    except TypeError:
        raise UnsupportedInputError(
            f"lort.ORTModule: {path or 'a value'} has type {type(obj).__name__}, which lort cannot pass "
            "through a compiled graph; supported: tensors, Python scalars, None, strings, lists, tuples, "
            "dicts, namedtuples, dataclasses, transformers ModelOutput and hashable constants"
        ) from None
    # Any other hashable object is a constant of the graph (compared by its own __eq__).
    return ("const", type(obj), obj)


def _by_reference(obj) -> bool:
    """Whether ``obj`` is passed to the graph as the object it is (an ``("object", cls)``
    leaf): an object compared by identity whose attributes hold state (tensors, lists,
    dicts), such as a cache that the forward fills, empty or not. Such objects differ on
    every call (generate makes a new cache each time) and Dynamo guards on what the graph
    reads from them; keying a schema on them would capture again for each one."""
    if isinstance(obj, (type, torch.nn.Module)) or callable(obj) or type(obj).__eq__ is not object.__eq__:
        return False
    attrs = getattr(obj, "__dict__", None)
    return isinstance(attrs, dict) and any(
        isinstance(v, (list, dict)) or _holds_tensors(v, 2) for v in attrs.values()
    )


def _holds_tensors(obj, depth: int) -> bool:
    """Whether ``obj``'s attributes hold a tensor, ``depth`` levels down (through lists,
    tuples, dicts and objects' attributes): a cache, whose tensors change from call to call."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, (_CONSTANT_TYPES, type, torch.nn.Module)) or callable(obj):
        return False
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensors(v, depth - 1) for v in obj)
    if isinstance(obj, dict):
        return any(_holds_tensors(v, depth - 1) for v in obj.values())
    attrs = getattr(obj, "__dict__", None)
    return isinstance(attrs, dict) and any(_holds_tensors(v, depth - 1) for v in attrs.values())


def _sub(path: str | None, suffix: str) -> str | None:
    return None if path is None else path + suffix


def _key_path(path: str, key) -> str:
    if not path:
        return str(key)
    return f"{path}[{key!r}]"


def unflatten(spec: tuple, tensors, objects=()) -> Any:
    """Rebuild the object ``flatten`` took apart, taking tensors in order from ``tensors``
    (and ``("object", cls)`` leaves from ``objects``)."""
    return _unflatten(spec, iter(tensors), iter(objects))


def _unflatten(spec, it: Iterator, objs: Iterator):
    kind = spec[0]
    if kind == "tensor":
        return next(it)
    if kind == "object":
        return next(objs)
    if kind == "const":
        return spec[2]
    if kind == "list":
        return [_unflatten(c, it, objs) for c in spec[1]]
    if kind == "tuple":
        return tuple([_unflatten(c, it, objs) for c in spec[1]])
    if kind == "namedtuple":
        return spec[1](*[_unflatten(c, it, objs) for c in spec[2]])
    if kind == "dict":
        cls, keys, children = spec[1], spec[2], spec[3]
        values = [_unflatten(c, it, objs) for c in children]
        if cls is dict:
            return dict(zip(keys, values))
        return cls(zip(keys, values))
    if kind == "model_output":
        cls, keys, children = spec[1], spec[2], spec[3]
        values = [_unflatten(c, it, objs) for c in children]
        return cls(**dict(zip(keys, values)))
    if kind == "dataclass":
        cls, init, children, rest = spec[1], spec[2], spec[3], spec[4]
        values = [_unflatten(c, it, objs) for c in children]
        obj = cls(**dict(zip(init, values[: len(init)])))
        for name, v in zip(rest, values[len(init):]):
            object.__setattr__(obj, name, v)
        return obj
    raise ValueError(f"lort.ORTModule: unknown spec node {kind!r}")


def describe(spec: tuple) -> str:
    """A short readable form of a spec: ``(Tensor, {'mask': Tensor, 'n': 3})``."""
    kind = spec[0]
    if kind == "tensor":
        return "Tensor"
    if kind == "const":
        return repr(spec[2])
    if kind == "object":
        return spec[1].__name__
    if kind == "list":
        return "[" + ", ".join(describe(c) for c in spec[1]) + "]"
    if kind == "tuple":
        inner = ", ".join(describe(c) for c in spec[1])
        return f"({inner},)" if len(spec[1]) == 1 else f"({inner})"
    if kind == "namedtuple":
        return f"{spec[1].__name__}(" + ", ".join(
            f"{f}={describe(c)}" for f, c in zip(spec[1]._fields, spec[2])) + ")"
    if kind in ("dict", "model_output"):
        body = ", ".join(f"{k!r}: {describe(c)}" for k, c in zip(spec[2], spec[3]))
        return "{" + body + "}" if spec[1] is dict else f"{spec[1].__name__}({{{body}}})"
    if kind == "dataclass":
        names = spec[2] + spec[4]
        return f"{spec[1].__name__}(" + ", ".join(f"{n}={describe(c)}" for n, c in zip(names, spec[3])) + ")"
    return repr(spec)


def _name(path: str) -> str:
    return f"input '{path}'" if path else "the input"


def _diff(old, new, path, out):
    if old == new:
        return
    if old[0] != new[0] or (old[0] not in ("list", "tuple", "const") and old[1] is not new[1]):
        out.append(f"{_name(path)} changed {_kind_name(old)} -> {_kind_name(new)}")
        return
    kind = old[0]
    if kind == "const":
        if old[1] is not new[1]:
            out.append(f"{_name(path)} changed {_kind_name(old)} -> {_kind_name(new)}")
        else:
            out.append(f"{_name(path)} value changed {old[2]!r} -> {new[2]!r}")
        return
    if kind in ("list", "tuple", "namedtuple"):
        a, b = old[-1], new[-1]
        if len(a) != len(b):
            out.append(f"{_name(path)} length changed {len(a)} -> {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
        return
    if kind in ("dict", "model_output", "dataclass"):
        a = dict(zip(old[2] + (old[4] if kind == "dataclass" else ()), old[3]))
        b = dict(zip(new[2] + (new[4] if kind == "dataclass" else ()), new[3]))
        for k in a:
            if k not in b:
                out.append(f"{_name(_key_path(path, k))} omitted (was passed)")
        for k in b:
            if k not in a:
                out.append(f"{_name(_key_path(path, k))} passed (was omitted)")
        for k in a:
            if k in b:
                _diff(a[k], b[k], _key_path(path, k), out)
        if not out and list(a) != list(b):
            out.append(f"{_name(path)} key order changed {list(a)} -> {list(b)}")
        return
    out.append(f"{_name(path)} changed {describe(old)} -> {describe(new)}")


def _kind_name(spec) -> str:
    kind = spec[0]
    if kind == "tensor":
        return "tensor"
    if kind == "const":
        return "None" if spec[2] is None else f"{spec[1].__name__} {spec[2]!r}"
    if kind in ("list", "tuple"):
        return kind
    return spec[1].__name__
