"""Horovod's exceptions (`horovod.common.exceptions`): kolo's own
(`kolo._errors`), the same classes, so that `except HostsUpdatedInterrupt`
here catches what kolo's core raises."""

from ..._errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
