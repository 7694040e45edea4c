"""The IOBinding lort's sessions run through (runtime/session.py): onnxruntime's C++
binding methods called directly, the device resolved once."""

from __future__ import annotations

import functools

import onnxruntime as ort
import torch


class FastBinding:
    """An IOBinding with its device resolved once.

    onnxruntime's public IOBinding wrapper resolves the device on every bind; on the
    hot path lort calls the bound C++ methods behind it directly (``_iobinding``,
    ``_sess``, ``OrtDevice._get_c_device``), and falls back to the public API if a
    future onnxruntime renames them."""

    def __init__(self, session: ort.InferenceSession, device: tuple[str, int]):
        self._public = session.io_binding()
        self._device = device
        self._session = session
        c_binding = getattr(self._public, "_iobinding", None)
        c_session = getattr(session, "_sess", None)
        try:
            c_device = ort.OrtDevice.make(*device)._get_c_device()
        except Exception:  # pragma: no cover - depends on the onnxruntime version
            c_device = None
        self._fast = c_binding is not None and c_session is not None and c_device is not None
        if self._fast:
            self._c_binding, self._c_device = c_binding, c_device
        #: ``bind_output_raw(name, device, element_type, shape, ptr)``, called with
        #: ``device`` for each output of each run: the C++ method where it exists.
        self.bind_output_raw = c_binding.bind_output if self._fast else self._public_bind_output
        self.device = c_device if self._fast else device
        if self._fast:  # ``run(run_options)`` without a Python frame
            self.run = functools.partial(c_session.run_with_iobinding, c_binding)

    def bind_input(self, name, element_type, shape, ptr) -> None:
        if self._fast:
            self._c_binding.bind_input(name, self._c_device, element_type, shape, ptr)
        else:  # pragma: no cover
            self._public.bind_input(name, self._device[0], self._device[1], element_type, shape, ptr)

    def _public_bind_output(self, name, device, element_type, shape, ptr) -> None:  # pragma: no cover
        self._public.bind_output(name, device[0], device[1], element_type, shape, ptr)

    def clear_outputs(self) -> None:
        """Let go of the outputs bound or returned by the last run."""
        if self._fast:
            self._c_binding.clear_binding_outputs()
        else:  # pragma: no cover
            self._public.clear_binding_outputs()

    def bind_output_device(self, name) -> None:
        """Let ORT allocate output ``name`` on the session's device at the next run (the
        C++ method with the device made once: the public one makes an OrtDevice per call;
        clearing and binding a 1.41B decoder step's 57 outputs took 157 against 22 us)."""
        if self._fast:
            self._c_binding.bind_output(name, self._c_device)
        else:  # pragma: no cover
            self._public.bind_output(name, self._device[0], self._device[1])

    def run(self, run_options) -> None:  # pragma: no cover - replaced per instance where fast
        self._session.run_with_iobinding(self._public, run_options)

    def output_tensors(self) -> list[torch.Tensor]:
        """Tensors owning the data of the ORT-allocated outputs of the last run (shapes
        known only after it), one DLPack call for all (25 outputs: 50 against 220 us one
        OrtValue at a time). The outputs are cleared before each such run, so ORT does
        not reuse their memory."""
        vector = self._c_binding.get_outputs() if self._fast else None
        if vector is not None and hasattr(vector, "to_dlpacks"):
            return vector.to_dlpacks(torch.from_dlpack)
        return [torch.from_dlpack(v._ortvalue.to_dlpack()) for v in self._public.get_outputs()]  # pragma: no cover
