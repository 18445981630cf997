"""A frozen patch encoder from a local TorchScript file (``model.features: {kind: torchscript, path: ...}``).

This is how a pathology foundation model trained and exported elsewhere becomes foveate's feature network::

    torch.jit.trace(model.eval(), torch.rand(1, 3, 224, 224)).save("enc.pt")   # or torch.jit.script(model).save

The file is read with ``torch.jit.load(path, map_location="cpu")`` (nothing is downloaded). The module must map
float patches ``[M, 3, s, s]`` to features ``[M, D]``; :class:`TorchScriptEncoder` gives it the patches in [0, 1],
normalised per channel with ``model.features.mean`` / ``std`` when set (foundation models expect ImageNet's).

The encoder is always frozen: its parameters never require gradients, it stays in eval mode when the model is put
in train mode, and it runs without autograd unless its input carries a gradient (soft patches with
``model.selection.scorer_grad > 0``: the gradient then flows through it to the selection, never into its weights).
Because it never changes, its weights are left out of the model's ``state_dict`` (loading a state dict keeps the
ones read from the file); checkpoints carry the TorchScript file's bytes instead, as a uint8 tensor
(:func:`as_tensor`, :func:`operators.checkpoint.checkpoint_dict`), so a model is scored elsewhere from its
checkpoint alone.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from operators.errors import ConfigError

__all__ = ["TorchScriptEncoder", "load_torchscript", "as_bytes", "as_tensor"]

_EXPORT_HINT = (
    "export one with torch.jit.trace(model.eval(), torch.rand(1, 3, 224, 224)).save(path) or "
    "torch.jit.script(model).save(path)"
)


def as_tensor(data: bytes) -> torch.Tensor:
    """A file's bytes as the 1-D uint8 tensor a checkpoint stores them in (``torch.save`` writes a tensor's bytes as
    they are; plain ``bytes`` under its default pickle protocol 2 grow by about half)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def as_bytes(value: Any, *, where: str = "checkpoint's 'torchscript'") -> bytes:
    """The bytes of a file stored as :func:`as_tensor` gives them (or as ``bytes``)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        return value.detach().cpu().contiguous().numpy().tobytes()
    got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(f"{where} must be the TorchScript file's bytes (a 1-D uint8 tensor or bytes), got {got}")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_torchscript(source: str | Path | bytes, *, where: str) -> torch.jit.ScriptModule:
    """``torch.jit.load`` of a file path or of a file's bytes, on the CPU.

    Raises:
        FileNotFoundError: no file at the path (the message names ``where``).
        ValueError: the file or bytes are not a TorchScript module (a ``torch.save`` state dict, a truncated file).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        target: Any = io.BytesIO(bytes(source))
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no such file (a TorchScript module is expected; {_EXPORT_HINT})")
        target = str(path)
    try:
        with warnings.catch_warnings():  # TorchScript is deprecated upstream (torch >= 2.13); these files are chosen
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.load. is deprecated", category=DeprecationWarning)
            module = torch.jit.load(target, map_location="cpu")
    except Exception as exc:  # a zip that is no TorchScript archive, not a zip, truncated
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{where} is not a TorchScript module: torch.jit.load cannot read it ({first}); a torch.save state dict "
            f"or pickled model will not do: {_EXPORT_HINT}"
        ) from None
    return module


class TorchScriptEncoder(nn.Module):
    """A frozen TorchScript module as the patch feature network.

    Args:
        cfg: the ``model.features`` section (:class:`operators.model_config.FeaturesConfig`, ``kind: torchscript``).
        data: the TorchScript file's bytes, or a checkpoint's ``ckpt["torchscript"]`` (:func:`as_tensor`), instead
            of reading ``cfg.path``.
        probe_size: side in pixels of the dummy batch run once to find (or check) the feature size, when
            ``cfg.input_size`` is unset (the model passes its patch input side).

    Attributes:
        module: the loaded ScriptModule (parameters never require gradients; eval mode).
        feature_dim: D, the size of a patch's feature vector.

    Shapes:
        ``forward(patches[M, 3, s, s] float in [0, 1]) -> features[M, D]`` (``s = cfg.input_size`` when set).

    Raises:
        FileNotFoundError / ValueError: see :func:`load_torchscript`; ValueError when the module does not give
        ``[M, D]`` on the dummy batch, ConfigError when D differs from ``cfg.feature_dim`` (each names the file).
    """

    def __init__(self, cfg: Any, *, data: bytes | torch.Tensor | None = None, probe_size: int = 224):
        super().__init__()
        if getattr(cfg, "kind", None) != "torchscript":
            raise ValueError(f"TorchScriptEncoder needs model.features.kind: torchscript, got {cfg!r}")
        self.cfg = cfg
        self.where = f"model.features.path {cfg.path!r}" + (" (from the checkpoint)" if data is not None else "")
        if data is not None:
            self._bytes: bytes | None = as_bytes(data)
            self._sha256 = hashlib.sha256(self._bytes).hexdigest()
            self.module = load_torchscript(self._bytes, where=self.where)
        else:
            self._bytes = None  # re-read from the file for a checkpoint (its digest checked): no copy held
            self.module = load_torchscript(cfg.path, where=self.where)
            self._sha256 = _sha256_file(Path(cfg.path).expanduser())
        for p in self.module.parameters():  # ScriptModule has no requires_grad_(); its parameters do
            p.requires_grad_(False)
        self.module.eval()
        for name, values in (("mean", cfg.mean), ("std", cfg.std)):
            t = None if values is None else torch.tensor(values, dtype=torch.float32).view(1, 3, 1, 1)
            self.register_buffer(name, t, persistent=False)
        self.register_state_dict_post_hook(_drop_module_keys)
        self.register_load_state_dict_pre_hook(_keep_module_tensors)
        side = int(cfg.input_size or probe_size)
        with torch.no_grad():
            out = self._run(torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(0)))
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 2 or not out.is_floating_point():
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"{self.where}: the module must map float patches [M, 3, s, s] to features [M, D]; on a dummy batch "
                f"[2, 3, {side}, {side}] it gave {got}"
            )
        found = int(out.shape[1])
        if cfg.feature_dim is not None and cfg.feature_dim != found:
            raise ConfigError(
                f"model.features.feature_dim={cfg.feature_dim} but the module of {self.where} gives {found} features "
                "per patch; set model.features.feature_dim: null (found when the model is built) or to "
                f"{found}"
            )
        self.feature_dim = found

    @property
    def sha256(self) -> str:
        """SHA-256 of the TorchScript file's bytes."""
        return self._sha256

    def torchscript_bytes(self) -> bytes:
        """The TorchScript file's bytes (for a checkpoint): those it was loaded from, or the file re-read.

        Raises:
            RuntimeError: the file changed (or went) since the model was built.
        """
        if self._bytes is not None:
            return self._bytes
        path = Path(self.cfg.path).expanduser()
        data = path.read_bytes() if path.is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != self._sha256:
            raise RuntimeError(
                f"{self.where} {'is gone' if data is None else 'changed'} since the model was built from it; the "
                "checkpoint must embed the encoder the model ran with"
            )
        return data

    def train(self, mode: bool = True) -> TorchScriptEncoder:
        """Always eval mode (frozen)."""
        return super().train(False)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            x = x - self.mean.to(x.dtype)
        if self.std is not None:
            x = x / self.std.to(x.dtype)
        return self.module(x)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if not isinstance(patches, torch.Tensor):
            raise TypeError(f"patches must be a torch.Tensor, got {type(patches).__name__}")
        if patches.dim() != 4 or patches.shape[1] != 3 or not patches.is_floating_point():
            raise ValueError(
                f"patches must be float [M, 3, s, s], got shape {tuple(patches.shape)} dtype {patches.dtype}"
            )
        size = self.cfg.input_size
        if size is not None and tuple(patches.shape[-2:]) != (size, size):
            raise ValueError(
                f"{self.where} takes {size}-px patches (model.features.input_size), got {tuple(patches.shape[-2:])}; "
                "patches are resampled to model.geometry.patch_input, which follows it"
            )
        if patches.shape[0] == 0:
            return patches.new_zeros((0, self.feature_dim))
        param = next(iter(self.module.parameters()), None)
        x = patches if param is None or not param.is_floating_point() else patches.to(param.dtype)
        with torch.set_grad_enabled(torch.is_grad_enabled() and x.requires_grad):
            out = self._run(x)
        if out.dim() != 2 or out.shape != (patches.shape[0], self.feature_dim):
            raise ValueError(
                f"{self.where}: the module gave {tuple(out.shape)} for {patches.shape[0]} patches, expected "
                f"[{patches.shape[0]}, {self.feature_dim}]"
            )
        return out.to(patches.dtype)


def _drop_module_keys(module: TorchScriptEncoder, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """The frozen module's weights stay out of the state dict (checkpoints carry the file's bytes)."""
    for key in [k for k in state_dict if k.startswith(prefix + "module.")]:
        del state_dict[key]


def _keep_module_tensors(
    module: TorchScriptEncoder,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    """Loading a state dict without the frozen module's weights keeps the ones read from the file."""
    for key, value in module.module.state_dict().items():
        state_dict.setdefault(prefix + "module." + key, value)
