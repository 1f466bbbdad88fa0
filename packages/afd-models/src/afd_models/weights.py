"""Where parameters come from: deterministic random init, or safetensors checkpoints.

A :class:`WeightSource` is asked for one tensor at a time, by :class:`ParamSpec`, so
each role materialises exactly the tensors it holds (role-filtered loading falls out of
asking: the attention role never asks for a routed expert, an FFN rank only for its
own). Every source records the names it was asked for in ``requested``, which tests use
to prove it.

Random weights are drawn per parameter *name*: the generator seed is a stable hash
(BLAKE2b, not Python's salted ``hash()``) of the model seed and the name, so an
attention rank, an FFN rank and the monolithic reference build bit-identical tensors
for the same name without exchanging anything, whichever subset each builds and in
whatever order.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_models.config import DeepseekConfig
from afd_models.device_random import normal_
from afd_models.errors import WeightsError
from afd_models.params import ModelParams, ParamKind, ParamSpec, WeightSelection

NORM_JITTER = 0.1
"""Random norm weights are ``1 + 0.1 * N(0, 1)``: near one, yet a misapplied norm shows."""
BIAS_STD = 0.05
"""Random ``noaux_tc`` correction bias: large enough to change some expert choices."""


class WeightSource(abc.ABC):
    """Hands out parameters by spec, in the requested dtype and device."""

    def __init__(self) -> None:
        self.requested: list[str] = []
        """Names asked for so far, in order (role-filtered loading is checked with it)."""

    def get(
        self, spec: ParamSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The tensor for ``spec``; float32 for specs that are always kept in float32."""
        self.requested.append(spec.name)
        tensor = self._load(spec)
        if tuple(tensor.shape) != spec.shape:
            raise WeightsError(
                f"{spec.name} has shape {tuple(tensor.shape)} in {self.describe()}, but the "
                f"configuration needs {spec.shape}; the checkpoint and config.json disagree"
            )
        target = torch.float32 if spec.float32 else dtype
        return tensor.to(device=device, dtype=target)

    @abc.abstractmethod
    def _load(self, spec: ParamSpec) -> torch.Tensor:
        """The raw tensor for ``spec`` (any dtype, any device)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the weights come from, for error messages."""


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the model seed and a parameter name (stable hash)."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RandomWeights(WeightSource):
    """Deterministic random parameters, identical per name whichever role builds them.

    Scales keep activations of order one through many layers: linear weights
    ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norm weights near one, a small
    correction bias. Values are drawn on ``device``: the CPU (the default) gives the same
    values everywhere; a GPU is faster for large presets and gives the same values in every
    process on any GPU, whatever share of its SMs the process has
    (:mod:`afd_models.device_random`: ``torch.randn`` on CUDA would not).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.seed = seed
        self.device = torch.device(device)

    def _load(self, spec: ParamSpec) -> torch.Tensor:
        seed = name_seed(self.seed, spec.name)
        if self.device.type == "cuda":
            values = torch.empty(spec.shape, device=self.device, dtype=torch.float32)
            normal_(values, seed)
        else:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            values = torch.randn(spec.shape, generator=gen, device=self.device, dtype=torch.float32)
        if spec.kind is ParamKind.LINEAR:
            return values.mul_(spec.shape[-1] ** -0.5)
        if spec.kind is ParamKind.NORM:
            return values.mul_(NORM_JITTER).add_(1.0)
        if spec.kind is ParamKind.BIAS:
            return values.mul_(BIAS_STD)
        return values

    def describe(self) -> str:
        return f"random weights (seed {self.seed})"


class SafetensorsWeights(WeightSource):
    """Reads tensors by name from a ``.safetensors`` file or a checkpoint directory.

    A directory may be sharded (``model.safetensors.index.json`` maps names to files)
    or hold any number of ``*.safetensors`` files. Only requested tensors are read;
    files are memory-mapped, so a role that needs a few tensors of a huge checkpoint
    reads just those.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._where = self._index(self.path)
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _index(path: Path) -> dict[str, Path]:
        if path.is_file():
            files = [path]
        elif path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text()).get("weight_map", {})
                return {name: path / file for name, file in weight_map.items()}
            files = sorted(path.glob("*.safetensors"))
        else:
            raise WeightsError(f"no checkpoint at {path}")
        if not files:
            raise WeightsError(f"{path} holds no .safetensors file")
        where: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 -- safe_open has no __iter__
                    where[name] = file
        return where

    def names(self) -> tuple[str, ...]:
        """Every tensor name in the checkpoint."""
        return tuple(self._where)

    def _load(self, spec: ParamSpec) -> torch.Tensor:
        file = self._where.get(spec.name)
        if file is None:
            raise WeightsError(
                f"{spec.name} is not in {self.describe()}; the checkpoint does not match the "
                f"configuration (wrong config.json, or a different model)"
            )
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt")
        tensor: torch.Tensor = handle.get_tensor(spec.name)
        return tensor

    def describe(self) -> str:
        return f"checkpoint {self.path}"


class RoundedWeights(WeightSource):
    """Another source's parameters rounded to ``rounding`` (e.g. bfloat16) and handed out
    at any dtype: the float32 *twin* of a lower-precision model. A model built from it in
    float32 computes the same function as the ``rounding`` model built from ``source``
    (every weight equal) with float32 arithmetic, so how far each is from the twin
    separates arithmetic rounding from a real difference. Specs kept in float32
    (``ParamSpec.float32``) are passed through unrounded, as the lower-precision model
    keeps them."""

    def __init__(self, source: WeightSource, rounding: torch.dtype) -> None:
        super().__init__()
        self.source = source
        self.rounding = rounding

    def _load(self, spec: ParamSpec) -> torch.Tensor:
        tensor = self.source._load(spec)
        if spec.float32:
            return tensor
        return tensor.to(self.rounding).to(torch.float32)

    def describe(self) -> str:
        return f"{self.source.describe()}, rounded to {str(self.rounding).removeprefix('torch.')}"


def materialize(
    config: DeepseekConfig,
    source: WeightSource,
    selection: WeightSelection | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Every tensor ``selection`` (default: the whole model) holds, by checkpoint name."""
    chosen = WeightSelection.monolithic() if selection is None else selection
    return {spec.name: source.get(spec, dtype) for spec in ModelParams(config).specs(chosen)}


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``tensors`` to one ``.safetensors`` file (views are copied out first)."""
    file = Path(path)
    plain = {name: t.detach().to("cpu").clone().contiguous() for name, t in tensors.items()}
    save_file(plain, str(file), metadata={"format": "pt", **(metadata or {})})
    return file


def save_checkpoint(
    directory: str | Path, config: DeepseekConfig, tensors: Mapping[str, torch.Tensor]
) -> Path:
    """A Hugging Face style directory: ``config.json`` and ``model.safetensors``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config.save_json(out / "config.json")
    save_safetensors(tensors, out / "model.safetensors")
    return out


def missing_names(config: DeepseekConfig, names: Iterable[str]) -> list[str]:
    """Parameters the whole model needs that ``names`` lacks (checks a checkpoint)."""
    have = set(names)
    specs = ModelParams(config).specs(WeightSelection.monolithic())
    return [spec.name for spec in specs if spec.name not in have]
