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
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, unset_fake_temporarily
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


def numpy_of_fakes(original):
    """``Tensor.numpy`` for every thread (autograd's device threads run activation recompute, which
    ``HostFunctionMode`` does not see): a cuda tensor raises as on a GPU, a host fake gives its known value
    or zeros."""

    def numpy(self, *args, **kwargs):
        if not _is_fake(self):
            return original(self, *args, **kwargs)
        if self.device.type != "cpu":
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                            f"copy the tensor to host memory first.")
        known = _known_value(self)
        with unset_fake_temporarily():
            return (known if known is not None else torch.zeros(self.shape, dtype=self.dtype)).numpy()

    return numpy


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
_MAX_KNOWN_NUMEL = 1 << 20  # values are followed for bookkeeping tensors only (a MoE routing map: tokens x experts)
# A constant fill larger than this is kept as one element broadcast to the shape (no host memory): an Adam
# moment of a MoE expert (zeros_like of a shard under the 1M-element limit) is one, thousands of them per rank.
_BROADCAST_FILL_NUMEL = 1 << 16


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


# Ops whose value is set by their arguments, not by input data: factories, and "like" ops of any tensor.
_FACTORIES = {"zeros", "ones", "full", "arange", "scalar_tensor", "eye", "linspace"}
_SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"}
_CONSTANT_FILLS = _SHAPE_ONLY | {"zeros", "ones", "full"}


def _compact_fill(host: torch.Tensor) -> torch.Tensor:
    """A constant fill as one element broadcast to its shape when it is large (see ``_BROADCAST_FILL_NUMEL``)."""
    if host.numel() <= _BROADCAST_FILL_NUMEL:
        return host
    with unset_fake_temporarily():  # a host tensor, whatever mode the caller runs in
        return host.reshape(-1)[:1].clone().expand(host.shape)


def _dense(value: torch.Tensor) -> torch.Tensor:
    """A broadcast value (``_compact_fill``) as its own storage, before it is written into."""
    return value.clone(memory_format=torch.contiguous_format) if value.numel() > 1 and 0 in value.stride() else value


def _balanced_topk_indices(shape, k: int, dim: int) -> torch.Tensor:
    """Indices of a top-k over unknown values: row r's j-th pick is ``(r * k + j) mod n`` (``n`` the size of
    ``dim``), so that every index is picked equally often, as by a balanced router."""
    n = shape[dim]
    moved = list(shape)
    moved.pop(dim)
    rows = int(torch.tensor(moved).prod()) if moved else 1
    picks = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % n
    return picks.reshape(*moved, k).movedim(-1, dim).contiguous()


def _host_or_zeros(x):
    """A tensor argument as a host tensor: its known value, or zeros (an unknown read as zero)."""
    if not isinstance(x, torch.Tensor):
        return x
    known = _known_value(x)
    if known is not None:
        return known
    with unset_fake_temporarily():
        zeros = torch.zeros((), dtype=x.dtype).expand(x.shape)  # read only: a large one stays broadcast
        return zeros if x.numel() > _BROADCAST_FILL_NUMEL else zeros.contiguous()


def _as_fake_on(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fake on ``like``'s device with ``host``'s shape and dtype (called inside the fake mode)."""
    return torch.empty(host.shape, dtype=host.dtype, device=like.device)


def follow_gather(output, inputs: list, group_size: int, *, stacked: bool) -> None:
    """The value of an all-gather's output when every input is known: every rank contributes what this
    rank does (the fake process group's symmetric world). ``stacked``: one output tensor holding the
    group's inputs along dim 0 (``all_gather_into_tensor``); else ``output`` is the list of per-rank
    tensors (``all_gather``)."""
    values = [_known_value(t) for t in inputs]
    if not inputs or any(v is None for v in values):
        return
    if stacked:
        with unset_fake_temporarily():
            host = values[0] if values[0].dim() else values[0].reshape(1)
            host = torch.cat([host] * group_size).reshape(output.shape)
        if _is_fake(output) and output.numel() <= _MAX_KNOWN_NUMEL:
            setattr(output, _VALUE, host)
        return
    for out in output:
        if _is_fake(out) and out.shape == values[0].shape:
            setattr(out, _VALUE, values[0])


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
            written = self._write_known(func, args, kwargs)
            for t in _tensors_in(args, kwargs):
                if _is_fake(t) and hasattr(t, _VALUE) and id(t) not in written:
                    delattr(t, _VALUE)
            if written:
                out = func(*args, **kwargs)
                for t in _tensors_in(args, kwargs):
                    if id(t) in written:
                        setattr(t, _VALUE, written[id(t)])
                return out
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            return self._dynamic_shape(func, args, kwargs)
        results = out if isinstance(out, (tuple, list)) else [out]
        fakes = [r for r in results if _is_fake(r)]
        if fakes and not func._schema.is_mutable and sum(r.numel() for r in fakes) <= _MAX_KNOWN_NUMEL:
            self._follow(func, args, kwargs, out)
            if func.overloadpacket is torch.ops.aten.topk and len(results) == 2 and not hasattr(results[1], _VALUE):
                self._balanced_topk(args, kwargs, results[1])
        return out

    @staticmethod
    def _write_known(func, args, kwargs) -> dict:
        """A write of known values into a fake of known value (``vec[i] = n`` on a small bookkeeping tensor):
        the op runs on the host values too, in place, so that views of one buffer, followed on the host as
        views, see it. Returns ``{id(fake): its new host value}``, empty when any input is unknown."""
        tensors = _tensors_in(args, kwargs)
        if not tensors or sum(t.numel() for t in tensors) > _MAX_KNOWN_NUMEL:
            return {}
        values = [_known_value(t) for t in tensors]
        if any(v is None for v in values):
            return {}
        hosts = {}
        with unset_fake_temporarily():
            for t, value in zip(tensors, values):
                # a fake's followed value is written in place (its views share it); anything else is copied
                hosts[id(t)] = _dense(value) if _is_fake(t) and getattr(t, "constant", None) is None \
                    else value.clone()
            swap = lambda x: hosts[id(x)] if isinstance(x, torch.Tensor) else x  # noqa: E731
            try:
                func(*tree_map(swap, args), **{k: tree_map(swap, v) for k, v in kwargs.items() if k != "device"})
            except Exception:  # noqa: BLE001 (an op that cannot run on the host values: the write forgets, as before)
                return {}
        return {id(t): hosts[id(t)] for t in tensors if _is_fake(t)}

    def _balanced_topk(self, args, kwargs, indices) -> None:
        # A top-k over unknown scores (a MoE router's) picks a balanced spread of indices; the values stay
        # unknown. Token counts per expert, split sizes and permutations then follow from known values.
        k = args[1] if len(args) > 1 else kwargs["k"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        dim = dim % args[0].dim() if args[0].dim() else 0
        if args[0].dim() == 0 or int(k) > args[0].shape[dim]:
            return
        with unset_fake_temporarily():
            host = _balanced_topk_indices(tuple(args[0].shape), int(k), dim).to(indices.dtype)
        if tuple(host.shape) == tuple(indices.shape):
            setattr(indices, _VALUE, host)

    def _dynamic_shape(self, func, args, kwargs):
        # Output shapes that depend on data (masked_select, nonzero, ...): the op runs on the host with the
        # known values and unknown ones read as zero (the rule for any read); the result is a fake of that
        # shape, whose value is known when every input was.
        tensors = _tensors_in(args, kwargs)
        host_args = tree_map(_host_or_zeros, args)
        host_kwargs = {k: tree_map(_host_or_zeros, v) for k, v in kwargs.items() if k != "device"}
        with unset_fake_temporarily():
            value = func(*host_args, **host_kwargs)
        values = value if isinstance(value, (tuple, list)) else [value]
        like = next(t for t in tensors if _is_fake(t))
        outs = [_as_fake_on(v, like) if isinstance(v, torch.Tensor) else v for v in values]
        if all(_known_value(t) is not None for t in tensors):
            for fake, host in zip(outs, values):
                if isinstance(host, torch.Tensor) and host.numel() <= _MAX_KNOWN_NUMEL:
                    setattr(fake, _VALUE, host)
        return type(value)(outs) if isinstance(value, (tuple, list)) else outs[0]

    def _follow(self, func, args, kwargs, out) -> None:
        tensors = _tensors_in(args, kwargs)
        if func.overloadpacket.__name__ in _SHAPE_ONLY:
            tensors = tensors[1:]  # the input gives only the shape: zeros_like(x) is known for any x
            args = (_host_or_zeros(args[0]), *args[1:])
        known = [_known_value(t) for t in tensors]
        name = func.overloadpacket.__name__
        if (tensors or name in _SHAPE_ONLY or name in _FACTORIES) and all(k is not None for k in known):
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
                    setattr(fake, _VALUE, _compact_fill(host) if name in _CONSTANT_FILLS else host)
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
