"""``python -m lort.runtime.build_native [-v]``: build lort's C++ frozen-weight check
(runtime/native.py) for the torch installed; ``make install`` runs it. Exit status 1
where it cannot be built (lort then checks frozen weights in Python)."""

from __future__ import annotations

import sys

from .native import build


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv[1:])
    except Exception as e:  # noqa: BLE001 - said, and the exit status says it
        sys.stderr.write(f"lort: building the C++ frozen-weight check failed: {e}\n"
                         "lort still works: it checks frozen weights in Python, which is slower.\n")
        return 1
    sys.stdout.write(f"lort: the C++ frozen-weight check is built: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
