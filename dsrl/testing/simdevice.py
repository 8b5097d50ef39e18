"""A simulated accelerator: tensors that hold CPU data but live on another device, and fail the
way CUDA fails when host and device tensors meet.

CI has no GPU, yet dsrl's device handling (what is moved to the engine's device, what is built
there, what comes back) must be right before a GPU ever runs it. Under `simulated_accelerator()`:

- `SimTensor` is a wrapper subclass that reports `device('meta')` (so autograd, `.device`
  comparisons and dtype logic behave as for any non-CPU tensor) and holds a CPU tensor. Every
  aten op on it runs on that data and returns SimTensors; an op that mixes a SimTensor with a
  host tensor of one or more dimensions raises CUDA's error ("Expected all tensors to be on the
  same device ..."). 0-dim host tensors are allowed, as CUDA allows them. `.item()`, `.tolist()`,
  `float()` read the data (CUDA syncs and copies); `.numpy()` fails as on CUDA.
- `x.to(SIM)` / `x.to(t.device)` of a host tensor, and factories called with `device=SIM`
  (`torch.zeros(..., device=t.device)`, also those inside autograd's backward formulas), give
  SimTensors; `x.to('cpu')` / `x.cpu()` of a SimTensor give a host tensor. Both moves are
  differentiable (aten's `_to_copy`, as real device copies).
- `on_simulated_device(owner)` puts an engine on the simulated device: `owner.engine` (the
  DeepSpeed engine of an ActorEngine or CriticEngine) is replaced by `SimulatedEngine`, whose
  `device` is SIM, until the block ends.

The boundary: the HF module's own forward (inside `engine(...)`), DeepSpeed's backward hooks,
gradient reduction and optimizer step keep running on the CPU parameters (DeepSpeed cannot build
a ZeRO engine on a fake device). Every tensor dsrl passes into the model must already be on the
engine's device (a host tensor there raises, as a CUDA module would), and what the model returns
comes out on the device, so everything dsrl computes around the model (log-probs, entropy,
objectives, reducers, masks, metrics, values) runs on SIM and is checked. Hooks that dsrl installs
inside the module (e.g. the LM head's row gather) run inside the boundary: a device tensor they
captured is read as its host data there.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SIM", "SimTensor", "SimulatedEngine", "simulated_accelerator", "on_simulated_device", "is_sim",
           "host_data", "to_sim"]

SIM = torch.device("meta")
_state = threading.local()


def _inside_module() -> bool:
    return getattr(_state, "inside", 0) > 0


class SimTensor(torch.Tensor):
    """CPU data on the simulated device (see the module docstring)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        if type(data) is not torch.Tensor or data.device.type != "cpu":
            raise TypeError(f"SimTensor wraps a plain CPU tensor, got {type(data).__name__} on {data.device}")
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype,
                                                layout=data.layout, device=SIM, requires_grad=False)
        t._data = data
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"SimTensor({self._data!r}, device='sim')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if not _inside_module() and func is not torch.ops.aten.copy_.default:  # copy_ may cross devices
            for t in flat:
                if isinstance(t, torch.Tensor) and not isinstance(t, SimTensor):
                    if t.device.type == "meta":
                        raise RuntimeError(f"simulated accelerator: {func} got a data-less meta tensor "
                                           "(built on the device by a path the simulation does not cover)")
                    if t.dim() > 0:
                        raise RuntimeError(
                            "Expected all tensors to be on the same device, but found at least two devices, "
                            f"meta (simulated accelerator) and {t.device}! (in {func}: a host tensor of shape "
                            f"{tuple(t.shape)} met a device tensor)")
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            kw = dict(kwargs)
            kw.pop("device")
            return func(args[0]._data, *args[1:], **kw)  # device -> host copy: a plain tensor
        args, kwargs = tree_map(lambda x: x._data if isinstance(x, SimTensor) else x, (args, kwargs))
        if _is_sim_device(kwargs.get("device")):  # e.g. new_zeros(..., device=x.device)
            kwargs = dict(kwargs, device=torch.device("cpu"))
        out = func(*args, **kwargs)
        if _inside_module():
            return out
        return _wrap(out)


def _wrap(out):
    """Every plain tensor in `out` (an op's result, possibly nested) as a SimTensor."""
    return tree_map(lambda x: SimTensor(x) if type(x) is torch.Tensor else x, out)


def is_sim(x: Any) -> bool:
    return isinstance(x, SimTensor)


def host_data(x: torch.Tensor) -> torch.Tensor:
    """The CPU data under a SimTensor (tests' own checks); host tensors as they are."""
    return x._data if isinstance(x, SimTensor) else x


def to_sim(x: torch.Tensor) -> torch.Tensor:
    """`x` on the simulated device (differentiable, as a real device copy); needs the accelerator on."""
    return x if isinstance(x, SimTensor) else x.to(SIM)


def to_host(x: torch.Tensor) -> torch.Tensor:
    return x.to("cpu") if isinstance(x, SimTensor) else x


def _is_sim_device(device) -> bool:
    if device is None or isinstance(device, int):
        return False
    try:
        return torch.device(device).type == "meta"
    except (TypeError, RuntimeError):
        return False


class _SimFunctionMode(TorchFunctionMode):
    """Inside the module boundary, device tensors a hook captured are read as their host data
    (before autograd records them); outside, `.tolist()` reads and `.numpy()` fails as on CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _inside_module():
            args, kwargs = tree_map(host_data, (args, kwargs))
            return func(*args, **kwargs)
        if func is torch.Tensor.tolist and isinstance(args[0], SimTensor):
            return args[0]._data.tolist()  # CUDA copies to the host and reads
        if func is torch.Tensor.numpy and isinstance(args[0], SimTensor):
            raise TypeError("can't convert meta (simulated accelerator) device type tensor to numpy. "
                            "Use Tensor.cpu() to copy the tensor to host memory first.")
        if _is_sim_device(kwargs.get("device")):  # torch.tensor(..., device=SIM) builds below the modes
            requires_grad = bool(kwargs.get("requires_grad", False))
            out = func(*args, **dict(kwargs, device=torch.device("cpu"), requires_grad=False)
                       if "requires_grad" in kwargs else dict(kwargs, device=torch.device("cpu")))
            out = _wrap(out)
            if requires_grad and isinstance(out, SimTensor):
                out.requires_grad_(True)
            return out
        return func(*args, **kwargs)


class _SimDispatchMode(TorchDispatchMode):
    """Every op that makes a tensor on SIM without reading one (factories, host -> device copies;
    also those autograd's backward formulas build, e.g. a 0-dim zero on the grad's device) runs
    on the CPU and returns SimTensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sim_device(kwargs.get("device")) and not any(isinstance(t, SimTensor) for t in tree_flatten(args)[0]):
            out = func(*args, **dict(kwargs, device=torch.device("cpu")))
            if func is torch.ops.aten._to_copy.default and out is args[0]:
                out = out.clone()
            return _wrap(out)
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[None]:
    """While active, SIM behaves as an accelerator (see the module docstring)."""
    with _SimFunctionMode(), _SimDispatchMode():
        yield


@contextlib.contextmanager
def _module_boundary() -> Iterator[None]:
    _state.inside = getattr(_state, "inside", 0) + 1
    try:
        yield
    finally:
        _state.inside -= 1


def _host_input(name: str, value):
    if isinstance(value, torch.Tensor):
        if not isinstance(value, SimTensor) and value.dim() > 0:
            raise RuntimeError(f"Expected all tensors to be on the same device: model input {name!r} is on "
                               f"{value.device}, the model on the simulated accelerator")
        return to_host(value)
    return value


def _device_output(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, SimTensor):
        return to_sim(value)
    if isinstance(value, dict):  # transformers ModelOutput is an OrderedDict
        for k in list(value.keys()):
            value[k] = _device_output(value[k])
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_device_output(v) for v in value)
    return value


class SimulatedEngine:
    """A DeepSpeed engine seen as if it ran on the simulated accelerator: `device` is SIM, the
    forward takes device tensors only and returns device tensors, `backward` takes a device
    loss; everything else is the real engine's."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    @property
    def device(self) -> torch.device:
        return SIM

    def __call__(self, *args, **kwargs):
        args = tuple(_host_input(f"arg {i}", a) for i, a in enumerate(args))
        kwargs = {k: _host_input(k, v) for k, v in kwargs.items()}
        with _module_boundary():
            out = self._engine(*args, **kwargs)
        return _device_output(out)

    def backward(self, loss, *args, **kwargs):
        if not isinstance(loss, SimTensor):
            raise RuntimeError(f"simulated accelerator: the loss is a host tensor on {loss.device}")
        return self._engine.backward(loss, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        setattr(self._engine, name, value)


@contextlib.contextmanager
def on_simulated_device(*owners, attr: str = "engine") -> Iterator[None]:
    """The simulated accelerator on, and each owner's engine (`owner.<attr>`: an ActorEngine's or
    CriticEngine's DeepSpeed engine, the LoRA pool's `peft` model) on it; restored on exit."""
    saved = [(o, getattr(o, attr)) for o in owners]
    try:
        for o, engine in saved:
            setattr(o, attr, SimulatedEngine(engine))
        with simulated_accelerator():
            yield
    finally:
        for o, engine in saved:
            setattr(o, attr, engine)
