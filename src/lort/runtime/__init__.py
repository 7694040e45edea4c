"""Runtime: ORT sessions cached by argument spec, zero-copy runs, run modes."""

from .session import stats

__all__ = ["stats"]
