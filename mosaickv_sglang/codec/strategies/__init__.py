"""Segment strategies, one per file; importing this package registers them all."""
from . import band, dense, lowbit, mask, topr  # noqa: F401  (registration)
from .base import Encoded, Strategy, parse_strategy, strategy_id, strategy_names

__all__ = ["Encoded", "Strategy", "parse_strategy", "strategy_id", "strategy_names"]
