"""Strategy interface and registry: one small class per way of storing a segment's K or V.

A strategy turns x [H, S, D] (already in the segment's basis) into a dict of tensors (everything
it physically keeps) and reads them back the way a decode kernel does: `qk` computes scores and
`pv` accumulates probabilities x values on the packed form, without rebuilding the dense
[H, S, D] tensor. `decode` (full reconstruction) exists for tests and the chooser's error
measurement only. Specs are strings such as ``"topr:r=16,val=fp8"``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

Tensors = dict[str, torch.Tensor]

_REGISTRY: dict[str, type["Strategy"]] = {}


@dataclass
class Encoded:
    """What one strategy keeps for one segment's K or V: the tensors, plus where they came from."""
    kind: str  # 'k' or 'v'
    shape: tuple[int, int, int]  # (heads, tokens, head_dim)
    tensors: Tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Strategy(ABC):
    name: ClassVar[str]
    #: the id segment headers carry (`strategy_id`): fixed per strategy, never reused, so a
    #: header means the same whatever else is registered or in which order modules import
    id: ClassVar[int]
    #: parameter name -> (type, default); `rot` (use the SVD basis) is common to every strategy.
    params: ClassVar[dict[str, tuple[type, object]]] = {}
    default_rot: ClassVar[bool] = True

    def __init__(self, **kwargs):
        allowed = dict(self.params, rot=(bool, self.default_rot))
        for key in kwargs:
            if key not in allowed:
                raise ValueError(
                    f"strategy '{self.name}' has no parameter '{key}'; known: {sorted(allowed)}")
        for key, (typ, default) in allowed.items():
            setattr(self, key, _checked(self.name, key, typ, kwargs.get(key, default)))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad parameter."""

    @property
    def spec(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in self.params]
        if self.rot != self.default_rot:
            parts.append(f"rot={int(self.rot)}")
        return self.name + (":" + ",".join(parts) if parts else "")

    def __repr__(self) -> str:
        return f"<{self.spec}>"

    @abstractmethod
    def encode(self, x: torch.Tensor, kind: str) -> Tensors:
        """x: float32 [H, S, D] in the segment basis; kind: 'k' or 'v'."""

    @abstractmethod
    def decode(self, e: Encoded) -> torch.Tensor:
        """Full float32 reconstruction [H, S, D] (tests and error measurement only)."""

    def encode_decoded(self, x: torch.Tensor, kind: str) -> tuple[Tensors, torch.Tensor]:
        """(encode(x), decode of it): what the chooser measures every candidate by. A strategy
        that can rebuild x from its codes before packing them overrides this (same result, one
        unpack less per try)."""
        tensors = self.encode(x, kind)
        return tensors, self.decode(Encoded(kind, tuple(x.shape), tensors))

    @abstractmethod
    def qk(self, e: Encoded, q: torch.Tensor) -> torch.Tensor:
        """q [H, G, D] (GQA group G per KV head) -> scores [H, G, S], on the packed form."""

    @abstractmethod
    def pv(self, e: Encoded, p: torch.Tensor) -> torch.Tensor:
        """p [H, G, S] -> sum_s p * x_s as [H, G, D], on the packed form."""


def _device(e: Encoded) -> torch.device:
    """Where an encoded segment lives (outputs are built there: CPU or the GPU pool)."""
    return next(iter(e.tensors.values())).device


def _checked(name: str, key: str, typ: type, value):
    """value as typ, or a ValueError naming the parameter (no silent int('4.0') / bool('no'))."""
    if typ is bool and value in (0, 1) and not isinstance(value, float):
        return bool(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is str and isinstance(value, str):
        return value
    raise ValueError(f"strategy '{name}': parameter '{key}' must be "
                     f"{'0/1' if typ is bool else typ.__name__}, got {value!r}")


def register(cls: type[Strategy]) -> type[Strategy]:
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy '{cls.name}' registered twice")
    sid = cls.__dict__.get("id")
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        raise ValueError(f"strategy '{cls.name}' needs its own fixed `id` (an int >= 0)")
    taken = {other.id: other.name for other in _REGISTRY.values()}
    if sid in taken:
        raise ValueError(f"strategy '{cls.name}': id {sid} is strategy '{taken[sid]}''s")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return list(_REGISTRY)


def strategy_id(name: str) -> int:
    """The fixed id a segment header carries for strategy `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy '{name}'; known: {strategy_names()}")
    return _REGISTRY[name].id


def parse_strategy(spec: str | Strategy) -> Strategy:
    """'name' or 'name:key=value,...' -> Strategy; errors name the bad part."""
    if isinstance(spec, Strategy):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"strategy spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.partition(":")
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy '{name}' in '{spec}'; known: {strategy_names()}")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"strategy spec '{spec}': expected key=value, got '{item}'")
        kwargs[key.strip()] = _coerce(value.strip())
    return _REGISTRY[name](**kwargs)


def _coerce(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        return value
