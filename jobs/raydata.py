"""A scoped change to Ray Data's current DataContext (the context a Dataset picks up when it is created)."""

from __future__ import annotations

import contextlib

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
