"""Data reads of fake tensors for the fake CUDA harness (``megatron_arpo.fake_cuda.harness``).

Fake tensors have shapes, not values. Code under test still reads values: counts with ``int()``,
validation with ``bool(torch.isfinite(x))``, sequence lengths from ``cu_seqlens.tolist()``. The rules
(see the harness docstring) live at two levels:

- :class:`DataReadMode`, a dispatch mode: every read reaches ``aten._local_scalar_dense`` there, on the
  calling thread and on autograd's device threads alike (backward, activation recompute). It follows the
  values of small fakes computed from known host values, tags health predicates, and answers reads.
- :class:`HostFunctionMode`, a torch-function mode (calling thread only): ``"cuda"`` means the current
  device, ``.numpy()`` of a cuda tensor raises as on a GPU, purely host computations run for real, and
  ``isfinite`` & co. are tagged before they decompose below the dispatch level.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

def _is_fake(x) -> bool:
    return isinstance(x, FakeTensor)


def _tensors_in(args, kwargs) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs))
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _mentions_cuda(args, kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    for x in flat:
        if isinstance(x, torch.device) and x.type == "cuda":
            return True
        if isinstance(x, str) and x.startswith("cuda"):
            return True
    return False


class HostFunctionMode(torch.overrides.TorchFunctionMode):
    """Host-side semantics at the torch-function level (the calling thread): ``"cuda"`` means the current
    device; ``.numpy()`` of a cuda tensor raises as on a GPU; operations whose tensor inputs are all real
    host tensors run for real, outside fake mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda" \
                and torch.device(device).index is None:
            # torch.tensor(..., device="cuda") under fake mode would otherwise ignore the current device
            kwargs = dict(kwargs, device=torch.device("cuda", torch.cuda.current_device()))
        if func is torch.Tensor.numpy:
            t = args[0]
            if t.device.type != "cpu":  # torch's own message on a GPU machine
                raise TypeError(f"can't convert {t.device} device type tensor to numpy. Use Tensor.cpu() to "
                                f"copy the tensor to host memory first.")
            if _is_fake(t):
                known = _known_value(t)

                with unset_fake_temporarily():
                    host = known if known is not None else torch.zeros(t.shape, dtype=t.dtype)
                    return host.numpy()
            return func(*args, **kwargs)
        tensors = _tensors_in(args, kwargs)
        if tensors and not any(_is_fake(t) for t in tensors) and not _mentions_cuda(args, kwargs) \
                and func is not torch.Tensor.cuda and all(t.device.type == "cpu" for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if _is_fake(result) and result.dtype == torch.bool and getattr(result, _TRUTH, None) is None:
            # isfinite & co. decompose before the dispatch level sees them: tag their answer here
            truth = _function_truth(func, args)
            if truth is not None:
                setattr(result, _TRUTH, truth)
        return result


_HEALTHY = {torch.isfinite: True, torch.Tensor.isfinite: True, torch.isnan: False, torch.Tensor.isnan: False,
            torch.isinf: False, torch.Tensor.isinf: False}
_PROPAGATE = {torch.all, torch.Tensor.all, torch.any, torch.Tensor.any}
_NEGATE = {torch.logical_not, torch.Tensor.logical_not, torch.Tensor.__invert__}
_COMBINE = {torch.Tensor.__and__: all, torch.logical_and: all, torch.Tensor.__or__: any, torch.logical_or: any}


def _function_truth(func, args):
    if func in _HEALTHY:
        return _HEALTHY[func]
    truths = [getattr(a, _TRUTH, None) for a in args if isinstance(a, torch.Tensor)]
    if func in _PROPAGATE and truths and truths[0] is not None:
        return truths[0]
    if func in _NEGATE and truths and truths[0] is not None:
        return not truths[0]
    if func in _COMBINE and truths and None not in truths:
        return _COMBINE[func](truths)
    return None


_VALUE = "_fake_cuda_value"  # the host value of a fake whose value is known
_TRUTH = "_fake_cuda_truth"  # the answer a healthy run gives for a bool fake of unknown value
_MAX_KNOWN_NUMEL = 1 << 16  # values are followed for small (bookkeeping) tensors only


def _known_value(t):
    if not isinstance(t, torch.Tensor):
        return None
    if not _is_fake(t):
        return t if t.device.type == "cpu" else None
    value = getattr(t, "constant", None)
    return getattr(t, _VALUE, None) if value is None else value


def _aten_tables():
    aten = torch.ops.aten
    healthy = {aten.isfinite: True, aten.isnan: False, aten.isinf: False}
    propagate = {aten.all, aten.any, aten.clone, aten._to_copy, aten.view, aten.reshape, aten.select, aten.slice,
                 aten.squeeze, aten.unsqueeze, aten.alias, aten.detach, aten.lift_fresh, aten.lift_fresh_copy}
    negate = {aten.logical_not, aten.bitwise_not}
    combine = {aten.logical_and: all, aten.bitwise_and: all, aten.logical_or: any, aten.bitwise_or: any}
    return healthy, propagate, negate, combine


def _dummy_scalar(t: torch.Tensor):
    if t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return 0.0
    return 0


class DataReadMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Data reads of fakes (``aten._local_scalar_dense``: item, bool, int, float, tolist), at the dispatch
    level so that they behave the same on autograd's device threads (backward, activation recompute).

    - Small fakes whose inputs are all known (real host tensors, or fakes with a known value) get their
      value computed on the host: ``torch.tensor([...])`` and what is derived from it (device moves,
      slicing, arithmetic), e.g. sequence lengths from ``cu_seqlens``. Writing into a fake forgets its
      value, except by a collective (the fake process group changes nothing: every rank contributes what
      this rank does).
    - Health predicates of unknown values answer as a healthy run would: ``isfinite`` True, ``isnan`` /
      ``isinf`` False, carried through all/any/not/and/or.
    - Anything else reads as zero (False).
    """

    def __init__(self):
        super().__init__()
        self.healthy, self.propagate, self.negate, self.combine = _aten_tables()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            t = args[0]
            known = _known_value(t)
            if known is not None:
                with unset_fake_temporarily():
                    return known.item()
            truth = getattr(t, _TRUTH, None)
            return _dummy_scalar(t) if truth is None else (truth if t.dtype == torch.bool else int(truth))
        if func._schema.is_mutable and func.namespace != "c10d":
            for t in _tensors_in(args, kwargs):
                if _is_fake(t) and hasattr(t, _VALUE):
                    delattr(t, _VALUE)
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else [out]
        fakes = [r for r in results if _is_fake(r)]
        if fakes and not func._schema.is_mutable and sum(r.numel() for r in fakes) <= _MAX_KNOWN_NUMEL:
            self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        tensors = _tensors_in(args, kwargs)
        known = [_known_value(t) for t in tensors]
        if tensors and all(k is not None for k in known):
            host_args = tree_map(lambda x: _known_value(x) if isinstance(x, torch.Tensor) else x, args)
            host_kwargs = {k: tree_map(lambda x: _known_value(x) if isinstance(x, torch.Tensor) else x, v)
                           for k, v in kwargs.items() if k != "device"}
            try:
                with unset_fake_temporarily():
                    value = func(*host_args, **host_kwargs)
            except Exception:  # noqa: BLE001 (an op that cannot run on the host values just stays unknown)
                return
            for fake, host in zip(out if isinstance(out, (tuple, list)) else [out],
                                  value if isinstance(value, (tuple, list)) else [value]):
                if _is_fake(fake) and isinstance(host, torch.Tensor) and host.shape == fake.shape:
                    setattr(fake, _VALUE, host)
            return
        if not _is_fake(out) or out.dtype != torch.bool:
            return
        packet = func.overloadpacket
        truths = [getattr(t, _TRUTH, None) for t in tensors]
        if packet in self.healthy:
            truth = self.healthy[packet]
        elif packet in self.propagate and truths and truths[0] is not None:
            truth = truths[0]
        elif packet in self.negate and truths and truths[0] is not None:
            truth = not truths[0]
        elif packet in self.combine and truths and None not in truths:
            truth = self.combine[packet](truths)
        else:
            return
        setattr(out, _TRUTH, truth)
