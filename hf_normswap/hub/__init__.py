"""Sharing variants on the Hub with their model cards."""

from .push import push


__all__ = ["push"]
