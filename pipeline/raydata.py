"""Ray Data helpers of the pipeline: a scoped DataContext change, and the one-line cause of an error Ray re-raised."""

from __future__ import annotations

import contextlib
import re

import ray.data


@contextlib.contextmanager
def data_context(preserve_order: bool | None = None, **changes):
    """Set DataContext attributes (and `execution_options.preserve_order`) for the block, then restore them."""
    ctx = ray.data.DataContext.get_current()
    old = {name: getattr(ctx, name) for name in changes}
    old_order = ctx.execution_options.preserve_order
    try:
        for name, value in changes.items():
            setattr(ctx, name, value)
        if preserve_order is not None:
            ctx.execution_options.preserve_order = preserve_order
        yield ctx
    finally:
        for name, value in old.items():
            setattr(ctx, name, value)
        ctx.execution_options.preserve_order = old_order


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*): (.+)$")


def short_error(err: BaseException) -> str:
    """`Type: message` of the root cause of an exception, on one line.

    Ray re-raises a remote failure with the remote traceback in its text (the user's exception first, then Ray's
    wrappers such as ``ray.exceptions.UserCodeException``); the first ``Type: message`` line that is not Ray's own
    names what went wrong.
    """
    for line in str(err).splitlines():
        m = _EXCEPTION_LINE.match(line)
        if m and not line.startswith("ray."):
            return f"{m.group(1)}: {m.group(2).strip()}"
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [t.strip() for t in str(cause).splitlines() if t.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
