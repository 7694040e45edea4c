"""``lort.ORTModule``: a drop-in for ``onnxruntime.training.ortmodule.ORTModule``.

    from lort import ORTModule, DebugOptions, LogLevel
    model = ORTModule(model, DebugOptions(log_level=LogLevel.INFO, save_onnx=True, onnx_prefix="bert"))
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward(); optimizer.step()

The wrapper behaves as the wrapped module: attributes and methods reach it (the wrapped
class's own methods are bound to the wrapper, so ``self(...)`` in ``generate`` or a
custom ``predict`` runs through ORT, as in onnxruntime-training), parameters,
buffers and state dicts carry the module's own names, ``train()``/``eval()`` and ``to()``
act on it. Calls go through the transition manager (``lort/module/transition.py``).

It is also transparent to inspection, as Hugging Face's Trainer and accelerate inspect a
model: ``ORTModule(m)`` is an instance of a subclass made once per wrapped class
(``ORTModule[BertForSequenceClassification]``) whose ``forward`` carries the signature of
the wrapped class's ``forward``. So ``inspect.signature(ORTModule(m).forward)`` equals
``inspect.signature(m.forward)`` (Trainer keeps the dataset columns it names), and
``find_labels``/``can_return_loss``, which read ``type(model).forward``, see the wrapped
model's labels.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
import threading
import weakref
from typing import Any, Iterator, Mapping

import torch
import torch.nn.modules.module as _nn_module

from ..options import Options
from . import methods
from .direct import MISS
from .transition import TransitionManager

# Read on every call (bound once: attribute lookups through torch cost a call's time).
_tracing_state = torch._C._get_tracing_state
_is_compiling = torch.compiler.is_compiling

logger = logging.getLogger("lort.module")


class LogLevel(enum.IntEnum):
    """ORTModule's log levels (same names and values as onnxruntime's)."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4

    @property
    def logging_level(self) -> int:
        """The ``logging`` level this level sets on the ``lort.module`` logger (VERBOSE is
        ``logging.DEBUG``, FATAL ``logging.CRITICAL``)."""
        return {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}[
            int(self)
        ]


_SAVE_PATH_ENV = "ORTMODULE_SAVE_ONNX_PATH"


def _writable(path: str) -> bool:
    """``path`` is a directory lort can write in, or one it can create."""
    while not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if parent == os.path.abspath(path):
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK)


class DebugOptions:
    """ORTModule's debug options (onnxruntime-training's fields, and ``save_path``).

    - ``log_level``: a ``LogLevel``, default ``LogLevel.WARNING``; sets the level of the
      ``lort.module`` logger (re-capture reasons are logged at INFO).
    - ``save_onnx``: a bool, default ``False``; write the ONNX models to ``save_path``:
      under onnxruntime-training's names (``{onnx_prefix}_torch_exported_training.onnx``,
      ``_optimized_pre_grad_training``, ``_optimized_{training,inference}``,
      ``_execution_model_{training,inference}``; module/debug_files.py says what each
      holds), and every compiled group's own,
      ``{onnx_prefix}_{train|eval}_s{schema}_g{n}_{forward|backward|inference}_{group}.onnx``,
      with ``{onnx_prefix}_{train|eval}_s{schema}_schema.txt`` describing the inputs.
    - ``onnx_prefix``: a string, default ``""``; the file name prefix, required (non-empty)
      with ``save_onnx``.
    - ``save_path``: a string, default ``""``: env ``ORTMODULE_SAVE_ONNX_PATH`` as in
      onnxruntime, else the current directory. With ``save_onnx`` it must be writable (or
      creatable), checked here as onnxruntime does.

    An unknown field raises ``TypeError``; errors carry onnxruntime-training's messages.
    """

    _FIELDS = ("log_level", "save_onnx", "onnx_prefix", "save_path")

    def __init__(self, log_level: LogLevel = LogLevel.WARNING, save_onnx: bool = False, onnx_prefix: str = "",
                 save_path: str = "", **unknown: Any):
        if unknown:
            raise TypeError(
                f"DebugOptions got unknown field(s) {sorted(unknown)}; valid fields are: {', '.join(self._FIELDS)}"
            )
        if not isinstance(log_level, LogLevel):
            raise TypeError(
                f"Expected log_level of type LogLevel, got {type(log_level)}. (DebugOptions log_level must be a "
                f"lort.LogLevel: VERBOSE, INFO, WARNING, ERROR, FATAL)"
            )
        if not isinstance(save_onnx, bool):
            raise TypeError(f"DebugOptions save_onnx must be a bool, not {type(save_onnx).__name__}")
        if not isinstance(save_path, str):
            raise TypeError(f"DebugOptions save_path must be a string, not {type(save_path).__name__}")
        path = save_path or os.environ.get(_SAVE_PATH_ENV, "") or os.getcwd()
        if save_onnx:
            if not _writable(path):
                raise OSError(f"Directory {path} is not writable. Please set the {_SAVE_PATH_ENV} environment "
                              "variable to a writable path.")
            if not isinstance(onnx_prefix, str):
                raise TypeError(f"Expected name prefix of type str, got {type(onnx_prefix)}.")
            if not onnx_prefix:
                raise ValueError("onnx_prefix must be provided when save_onnx is set.")
        elif not isinstance(onnx_prefix, str):
            raise TypeError(f"Expected name prefix of type str, got {type(onnx_prefix)}.")
        self.log_level = log_level
        self.save_onnx = save_onnx
        self.onnx_prefix = onnx_prefix
        self.save_path = path

    def __repr__(self) -> str:
        return (f"DebugOptions(log_level=LogLevel.{self.log_level.name}, save_onnx={self.save_onnx}, "
                f"onnx_prefix={self.onnx_prefix!r}, save_path={self.save_path!r})")


def _configure_logging(level: LogLevel) -> None:
    mod_logger = logging.getLogger("lort.module")
    mod_logger.setLevel(level.logging_level)
    # The "lort" logger has only a NullHandler: with no logging configured anywhere,
    # give lort.module a stream handler so the chosen level is seen (as ORTModule did).
    if not logging.getLogger().handlers and not mod_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        mod_logger.addHandler(handler)


# Names set on the wrapper itself; every other attribute assignment goes to the module.
# ``forward`` (and accelerate's ``_original_forward``) stay on the wrapper: replacing the
# wrapper's forward, as accelerate does to add autocast, must wrap the wrapper's call, not
# make the wrapped module call the wrapper back.
_OWN = ("_lort_module", "_lort_manager", "_lort_debug", "_lort_options", "_lort_view", "forward",
        "_original_forward")

#: One ORTModule subclass per wrapped class (see the module docstring).
_CLASSES: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()
_classes_lock = threading.Lock()


def _class_for(module_cls: type) -> type:
    """The ORTModule subclass whose ``forward`` has the signature of ``module_cls.forward``."""
    with _classes_lock:
        cls = _CLASSES.get(module_cls)
        if cls is None:
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return self._lort_manager(args, kwargs)

            try:
                forward.__signature__ = inspect.signature(module_cls.forward)
            except (TypeError, ValueError):  # no signature to show: keep (*args, **kwargs)
                pass
            forward.__doc__ = getattr(module_cls.forward, "__doc__", None)
            name = f"ORTModule[{module_cls.__name__}]"
            forward.__qualname__ = f"{name}.forward"
            cls = type(ORTModule)(name, (ORTModule,), {"forward": forward, "__module__": __name__,
                                                      "__qualname__": name, "__doc__": ORTModule.__doc__,
                                                      "_lort_wrapped_class": module_cls})
            _CLASSES[module_cls] = cls
        return cls


def _restore(module_cls: type) -> "ORTModule":
    """Unpickling: an empty wrapper of the right class (``__setstate__`` fills it)."""
    return torch.nn.Module.__new__(_class_for(module_cls))


class _WrapperClass(type):
    """The type of ORTModule classes: a class attribute ORTModule[C] lacks is C's
    (transformers' ``generate`` reads its decoding methods as ``getattr(type(self),
    name)`` and calls them with the wrapper)."""

    def __getattr__(cls, name: str) -> Any:
        wrapped = cls.__dict__.get("_lort_wrapped_class")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        return getattr(wrapped, name)


class ORTModule(torch.nn.Module, metaclass=_WrapperClass):
    """Runs ``module`` through ONNX Runtime (forward and backward) with lort.

    ``ORTModule(module, debug_options=None, *, options=None)``: ``options`` are
    ``lort.Options`` (or a dict) for the compiled graphs; ``options.fallback`` (env
    ``LORT_FALLBACK_POLICY``) says what happens when the module cannot be captured or
    compiled: ``"warn"`` runs it in PyTorch with one warning, ``"raise"`` raises
    ``lort.CaptureError``. ``options.schema_cache_size`` bounds the cached schemas.
    """

    def __new__(cls, module: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> "ORTModule":
        if cls is ORTModule and isinstance(module, torch.nn.Module) and not isinstance(module, ORTModule):
            cls = _class_for(type(module))
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 options: Options | Mapping[str, Any] | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        if isinstance(module, ORTModule):
            raise TypeError("ORTModule: the module is already an ORTModule")
        if debug_options is None:
            explicit = False
            debug_options = DebugOptions()
        elif not isinstance(debug_options, DebugOptions):
            hint = (" (lort.Options go by keyword: ORTModule(module, options=...))"
                    if isinstance(debug_options, Options) else "")
            raise TypeError(
                f"ORTModule debug_options must be a lort.DebugOptions, not {type(debug_options).__name__}{hint}")
        else:
            explicit = True
        super().__init__()
        opts = Options.resolve(options)
        object.__setattr__(self, "_lort_module", module)
        object.__setattr__(self, "_lort_debug", debug_options)
        object.__setattr__(self, "_lort_options", opts)
        object.__setattr__(self, "training", module.training)
        if explicit:
            _configure_logging(debug_options.log_level)
        self._lort_build_manager()

    def _lort_build_manager(self) -> None:
        dbg = self._lort_debug
        save = (dbg.save_path, dbg.onnx_prefix) if dbg.save_onnx else None
        manager = TransitionManager(self._lort_module, self._lort_options, type(self._lort_module).__name__, save)
        object.__setattr__(self, "_lort_manager", manager)

    # -- calls -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ only calls forward where no hook is registered (on the
        # wrapper or globally), the wrapper is not compiled (``compile()``), its forward
        # not replaced on the instance (accelerate) and nothing traces: then the manager
        # is called directly, a few microseconds less a call.
        d = self.__dict__
        if (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"] or d["_backward_hooks"]
                or "forward" in d or d.get("_compiled_call_impl") is not None or _nn_module._global_forward_pre_hooks
                or _nn_module._global_forward_hooks or _nn_module._global_backward_pre_hooks
                or _nn_module._global_backward_hooks or _tracing_state() or _is_compiling()):
            return super().__call__(*args, **kwargs)
        manager = d["_lort_manager"]
        lane = manager.lane
        if lane is not None and not kwargs:  # a call made as the last direct one
            out = lane(args)
            if out is not MISS:
                return out
        return manager.full(args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._lort_manager(args, kwargs)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (its parameters are the ones trained)."""
        return self._lort_module

    @property
    def transition_manager(self) -> TransitionManager:
        """The transition manager: ``captures`` (entry and reason of each capture),
        ``entries`` (cached schemas), ``records`` (every compiled graph)."""
        return self._lort_manager

    # -- attributes reach the module ---------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if "_lort_module" in d:
            # The wrapped class's own methods are bound to the wrapper (module/methods.py):
            # ``self(...)`` inside ``generate``, ``predict`` or ``encode`` runs through ORT.
            return methods.bound(getattr(d["_lort_module"], name), d["_lort_module"], name, self)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        # As onnxruntime-training's ORTModule: a name the wrapper holds (its own state,
        # nn.Module's dicts, a method assigned on it before) or a method of the wrapped
        # class (which that ORTModule copied onto itself) is set on the wrapper and
        # leaves the user's module alone; anything else (parameters, buffers,
        # submodules, new attributes) goes to the module, which then captures again.
        d = self.__dict__
        if name == "training" and "_lort_module" in d:
            setattr(d["_lort_module"], name, value)
            object.__setattr__(self, name, value)
        elif (name in _OWN or name in d or "_lort_module" not in d
              or methods.is_user_method(d["_lort_module"], name, ORTModule)):
            object.__setattr__(self, name, value)
        else:
            setattr(d["_lort_module"], name, value)

    def __delattr__(self, name: str) -> None:
        # A method assigned on the wrapper: deleting it shows the module's own again.
        if name in self.__dict__ and name != "training":
            object.__delattr__(self, name)
        else:
            delattr(self._lort_module, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self._lort_module)))

    def __repr__(self) -> str:
        return f"ORTModule({self._lort_module!r})"

    # -- parameters, buffers, submodules: the module's own names -----------------------
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._lort_module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._lort_module.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self._lort_module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._lort_module.named_buffers(prefix, recurse, remove_duplicate)

    def children(self):
        return self._lort_module.children()

    def named_children(self):
        return self._lort_module.named_children()

    def modules(self):
        return self._lort_module.modules()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        return self._lort_module.named_modules(memo, prefix, remove_duplicate)

    def get_submodule(self, target: str) -> torch.nn.Module:
        return self._lort_module.get_submodule(target)

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        return self._lort_module.get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        return self._lort_module.get_buffer(target)

    def state_dict(self, *args: Any, **kwargs: Any):
        return self._lort_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        result = self._lort_module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self._lort_manager.invalidate("load_state_dict(assign=True) replaced the parameters")
        return result

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # A parent's load_state_dict reaches the wrapper here (the wrapper registers no
        # children): load the wrapped module's keys under this prefix.
        sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = self._lort_module.load_state_dict(sub, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        self._lort_module.add_module(name, module)

    register_module = add_module

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        self._lort_module.register_parameter(name, param)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        self._lort_module.register_buffer(name, tensor, persistent)

    # -- modes, conversion -----------------------------------------------------------
    def train(self, mode: bool = True) -> "ORTModule":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self._lort_module.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> "ORTModule":
        self._lort_module.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._lort_module.zero_grad(set_to_none)

    def _apply(self, fn, recurse: bool = True):
        # to(), cpu(), cuda(), float(), double(), half(), ... end here.
        self._lort_module._apply(fn, recurse)
        self._lort_manager.invalidate("module converted (to(), cpu(), double(), ...)")
        return self

    def apply(self, fn) -> "ORTModule":
        self._lort_module.apply(fn)
        return self

    # -- pickling: the module and options travel; compiled graphs are rebuilt ------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lort_manager", None)
        return state

    def __reduce_ex__(self, protocol: int):
        # The class is made per wrapped class (not importable by name): rebuild it from
        # the wrapped class, which pickles as usual.
        return _restore, (type(self._lort_module),), self.__getstate__()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lort_build_manager()
