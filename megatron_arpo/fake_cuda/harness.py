"""Fake CUDA: run one rank of any Megatron layout in this process, on fake GPU tensors, with no GPU.

Our users run the actor on GPUs; this machine has none. This harness makes the actor's *GPU* branches
run here: ``torch.cuda.is_available()`` is True, devices are ``cuda:N``, the process group claims NCCL,
parameters are bf16 on the device. It is built from the facts measured in
``docs/design/fake_cuda.md``:

- Tensors are ``FakeTensorMode(avoid_device_init=True)`` fakes: shapes, dtypes and devices are real,
  storage is not (no memory, no arithmetic). Mixing a cuda and a cpu tensor raises, as on a GPU.
- The default process group uses torch's ``fake`` backend (collectives are no-ops) at any world size,
  with this process as any rank. Megatron's gloo groups are created on ``fake`` too; each group's
  *intended* backend is remembered (:meth:`FakeCudaSession.intended_backend`) and reported by
  ``dist.get_backend``, so code that picks a device from the backend takes its NCCL branch.
- A small C++ extension (``guard.cpp``, built on first use with
  ``torch.utils.cpp_extension.load`` and cached under ``.cache/fake_cuda`` keyed by the torch version
  and the source hash) registers a fake CUDA device guard and makes ATen report CUDA as the current
  accelerator; a CPU-only torch has neither, and indexing, ``.cuda()`` and autograd on fake cuda
  tensors need both. If it cannot be built (no C++ compiler), :func:`load_guard` raises
  :class:`FakeCudaUnavailable` with the reason; tests skip showing it, never pass silently.
- ``torch.cuda`` stubs: availability, device count/index/capability (9, 0)/properties, synchronize,
  streams (``current_stream().synchronize()``, side streams ``torch.cuda.Stream()`` with
  ``torch.cuda.stream(s)``, events, ``Tensor.record_stream``: work is never pending), memory queries, and the CUDA RNG API mapped onto the
  CPU generator. ``reduce_tensor`` of a fake cuda tensor (a CUDA-IPC export) returns
  ``rebuild_cuda_tensor`` arguments whose handle names the exported storage (``fake-ipc:<id>``: views
  of one buffer share it), so a test can tell one reused IPC buffer from a fresh one per export.
- **Trace** (:attr:`FakeCudaSession.trace`): every collective this rank takes part in (with the
  group's global ranks), barriers and object collectives included, and every stream or device
  synchronize, in program order. With the traces of all ranks a test orders events across ranks
  (the n-th collective of a group joins its members).
- **Collective checker**: all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter(_tensor),
  reduce, gather, scatter, all_to_all(_single), send, recv and batch_isend_irecv are wrapped (one wrapper
  per process, reporting to the active session: Megatron binds some at import); a non-cuda tensor
  passed to a group whose intended backend is NCCL is recorded with the call site (the first frame
  outside torch, megatron and this module's wrappers). ``isend``/``irecv`` themselves are not wrapped:
  ``P2POp`` checks their identity; their tensors are checked in ``batch_isend_irecv``.
- **Data-dependent reads** of fakes (``.item()``, ``bool()``, ``int()``, ``float()``, ``.tolist()``: all
  reach ``aten._local_scalar_dense``) are answered at the dispatch level, so that backward and
  activation recompute on autograd's device threads see the same rules:
  - small fakes computed only from known values (``torch.tensor([...])``, real host tensors, and what
    is derived from them: device moves, slicing, arithmetic; e.g. sequence lengths from
    ``cu_seqlens``) read their real values, computed on the host; writing into a fake forgets its value,
    a collective does not (every rank contributes what this rank does: an all-gather of known inputs
  is known); factories (``zeros``, ``arange``...) and ``zeros_like`` & co. are known, and a write of
  known values into a known fake updates it (``vec[i] = n``);
  - a top-k over unknown values picks a balanced spread of indices (row r's j-th pick is
    ``(r * k + j) mod n``), as a balanced MoE router would: token counts per expert, all-to-all split
    sizes and permutations then follow from known values;
  - ops whose output shape depends on data (``masked_select``, ``nonzero``) run on the host with the
    known values and unknown ones read as zero;
  - health predicates answer as a healthy run would (``isfinite`` True, ``isnan``/``isinf`` False,
    carried through ``all``/``any``/not/and/or), so validation of finite values passes;
  - anything else reads as 0 (False).
  ``.numpy()`` of a cuda tensor raises ``TypeError`` exactly as torch does on a GPU; of a host fake it
  is the known value or zeros. Operations whose tensor inputs are all real host tensors run for real,
  outside fake mode (e.g. Megatron's comparison of CPU RNG states inside ``CudaRNGStatesTracker.fork``).
- **Object collectives** are emulated symmetrically: ``all_gather_object`` / ``gather_object`` see every
  rank contribute this rank's object. A receiver of ``broadcast_object_list`` / ``scatter_object_list``
  gets the message recorded from the sending rank's own run when the caller passes it
  (``peer_messages``: :attr:`FakeCudaSession.sent_messages` of an earlier session as that rank);
  otherwise its list is left as it is, and the miss is listed in
  :attr:`FakeCudaSession.missing_peer_messages`.

Harness gaps (not bugs of the code under test), each patched only inside a session:
- coalesced collectives have no fake implementation: ``_coalescing_manager`` is replaced by one that
  issues the bucket collectives one by one;
- Megatron's pipeline shape exchange (``variable_seq_lengths``) would receive dummy shapes: the
  received shape is the schedule's ``tensor_shape`` (callers feed micro-batches of one shape);
- Megatron's no-apex gradient norm builds a host tensor from per-tensor norms: replaced by a
  stack/norm on the device;
- Megatron's cross-rank checkpoint validation (sharding coverage, common state equal on all ranks)
  needs every rank's data; with one rank it is skipped,
  and ``torch.distributed.checkpoint`` plans as a world of one (each rank writes and reads its own
  shards, as the main replica of all of them; the ``.metadata`` file then describes this rank only). The files Megatron's global rank 0
  writes for a dist checkpoint (``metadata.json``, ``common.pt``) are written by this rank too, since
  no other process will.

Process-wide effects that outlive a session: the extension (CUDA stays the accelerator of this
process) and autograd's device threads; Megatron's MoE globals that hold a session's tensors or streams
are dropped at its end (``gaps.reset_megatron_globals``). Run one session per process (tests use a subprocess per
scenario); a session refuses to start when the CPU compat layer (``megatron_arpo.device.cpu_compat``)
is already active in the process, since the two make opposite claims about CUDA.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import io
import logging
import os
import shutil
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.cuda import nccl
from torch.multiprocessing import reductions
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_arpo.device import cpu_compat
from megatron_arpo.fake_cuda.gaps import (install_host_io, install_megatron_gaps, install_module_moves,
                                          reset_megatron_globals)
from megatron_arpo.fake_cuda.reads import (DataReadMode, HostFunctionMode, _tensors_in, follow_gather,
                                           numpy_of_fakes)

logger = logging.getLogger(__name__)

GUARD_SOURCE = Path(__file__).with_name("guard.cpp")
CACHE_ENV = "MEGATRON_ARPO_FAKE_CUDA_CACHE"
DEVICE_CAPABILITY = (9, 0)
DEVICE_MEMORY_BYTES = 80 * 2**30
MAX_DEVICES = 8  # c10's FakeGuardImpl models eight devices

_guard_module = None
_guard_error: str | None = None
_guard_lock = threading.Lock()


class FakeCudaUnavailable(RuntimeError):
    """The fake CUDA extension cannot be built or loaded here; the message says why."""


class CollectiveViolation(AssertionError):
    """A non-CUDA tensor was passed to an NCCL collective (listed with call sites)."""


# ------------------------------------------------------------------------------------------ extension
def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    repo = Path(__file__).resolve().parents[2]
    if (repo / "setup.py").exists() and os.access(repo, os.W_OK):
        return repo / ".cache" / "fake_cuda"
    return Path.home() / ".cache" / "megatron-arpo" / "fake_cuda"


def guard_cache_key() -> str:
    digest = hashlib.sha256(GUARD_SOURCE.read_bytes()).hexdigest()[:12]
    return f"torch{torch.__version__.replace('+', '_').replace('.', '_')}_{digest}"


def load_guard():
    """Build (first use) or load the cached C++ guard; raises :class:`FakeCudaUnavailable` naming the cause."""
    global _guard_module, _guard_error
    with _guard_lock:
        if _guard_module is not None:
            return _guard_module
        if _guard_error is not None:
            raise FakeCudaUnavailable(_guard_error)
        if torch.version.cuda is not None or torch.version.hip is not None:
            _guard_error = (f"torch {torch.__version__} is a GPU build; the fake CUDA harness needs a CPU-only "
                            f"torch (a real CUDA device guard is already registered)")
            raise FakeCudaUnavailable(_guard_error)
        key = guard_cache_key()
        name = f"megatron_arpo_fake_cuda_{key}"
        build_dir = _cache_root() / key
        compiler = os.environ.get("CXX", "c++")
        if not (build_dir / f"{name}.so").exists() and shutil.which(compiler) is None:
            _guard_error = (f"no C++ compiler ({compiler!r} not on PATH) to build {GUARD_SOURCE.name}; install "
                            f"g++ (apt-get install g++) or set CXX")
            raise FakeCudaUnavailable(_guard_error)
        # deferred: pulls in torch.utils.cpp_extension (heavy; this module imports without it)
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(build_dir / ".build.flock", "w") as held:
                # torch's own build lock is a plain file ("lock"): a builder killed mid-build leaves it behind
                # and every later load waits for it forever. Builders take this flock first (the kernel drops
                # it with its process), so a torch lock found while holding it is stale.
                fcntl.flock(held, fcntl.LOCK_EX)
                (build_dir / "lock").unlink(missing_ok=True)
                module = load(name=name, sources=[str(GUARD_SOURCE)], build_directory=str(build_dir), verbose=False)
        except Exception as exc:  # compiler errors, missing headers, ninja, linker: all mean "unavailable"
            _guard_error = (f"building {GUARD_SOURCE.name} in {build_dir} failed: {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}")
            raise FakeCudaUnavailable(_guard_error) from exc
        if not module.guard_registered() or not module.install_hooks():
            _guard_error = "the fake CUDA extension loaded but did not take effect (guard or hooks missing)"
            raise FakeCudaUnavailable(_guard_error)
        _guard_module = module
        return module


# --------------------------------------------------------------------------------------- patch stack
class _Patches:
    """Attribute patches undone in reverse order."""

    def __init__(self):
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def set(self, obj, name: str, value) -> None:
        had = hasattr(obj, name) and name in vars(obj) if isinstance(obj, type) else hasattr(obj, name)
        self._undo.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, old, had = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


# --------------------------------------------------------------------------------------- torch.cuda
@dataclass
class _DeviceState:
    index: int = 0


class _FakeStream:
    """The current stream of the fake device: work is never pending, a synchronize is traced."""

    def __init__(self, device: "_DeviceState", trace: list):
        self._device, self._trace = device, trace

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._device.index)

    def synchronize(self) -> None:
        self._trace.append(("sync", "stream"))

    def query(self) -> bool:
        return True

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "_FakeEvent":
        event = event if event is not None else _FakeEvent(self._trace)
        event.record(self)
        return event


class _FakeEvent:
    """A CUDA event on the fake device: always complete; a synchronize is traced."""

    def __init__(self, trace: list, *args, **kwargs):
        self._trace = trace

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._trace.append(("sync", "event"))

    def elapsed_time(self, end) -> float:
        return 0.0


def _install_cuda_stubs(patches: _Patches, device: _DeviceState, num_devices: int, guard,
                        trace: list | None = None) -> None:
    cuda = torch.cuda
    trace = [] if trace is None else trace
    stream = _FakeStream(device, trace)

    def _index(d=None) -> int:
        if d is None:
            return device.index
        if isinstance(d, int):
            return d
        d = torch.device(d)
        return device.index if d.index is None else d.index

    def new_stream(device=None, priority=0, **kwargs) -> _FakeStream:  # a side stream (e.g. MoE device-to-host copies)
        return _FakeStream(device, trace)

    @contextlib.contextmanager
    def use_stream(s):
        yield s

    def record_stream(self, stream) -> None:  # the caching allocator's bookkeeping; no allocator here
        if not (isinstance(self, FakeTensor) and self.device.type == "cuda"):
            raise RuntimeError("record_stream on a non-CUDA tensor (the fake CUDA harness only has fake devices)")

    def set_device(d) -> None:
        idx = _index(d)
        if not 0 <= idx < num_devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {idx} (fake CUDA has {num_devices} devices)")
        device.index = idx
        guard.set_device(idx)

    props = SimpleNamespace(name="Fake H100 (megatron_arpo.fake_cuda.harness)", major=DEVICE_CAPABILITY[0],
                            minor=DEVICE_CAPABILITY[1], total_memory=DEVICE_MEMORY_BYTES,
                            multi_processor_count=132, is_integrated=False, is_multi_gpu_board=False,
                            L2_cache_size=50 * 2**20, warp_size=32, gcnArchName="", uuid="fake")
    cpu_gen = torch.default_generator

    def manual_seed(seed) -> None:
        cpu_gen.manual_seed(int(seed))

    stubs = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "device_count": lambda: num_devices,
        "current_device": lambda: device.index,
        "set_device": set_device,
        "get_device_capability": lambda d=None: DEVICE_CAPABILITY,
        "get_device_properties": lambda d=None: props,
        "get_device_name": lambda d=None: props.name,
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": lambda d=None: trace.append(("sync", "device")),
        "current_stream": lambda d=None: stream,
        "default_stream": lambda d=None: stream,
        "Stream": new_stream,
        "stream": use_stream,
        "Event": lambda *a, **k: _FakeEvent(trace, *a, **k),
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "memory_allocated": lambda d=None: 0,
        "max_memory_allocated": lambda d=None: 0,
        "memory_reserved": lambda d=None: 0,
        "max_memory_reserved": lambda d=None: 0,
        "reset_peak_memory_stats": lambda d=None: None,
        "mem_get_info": lambda d=None: (DEVICE_MEMORY_BYTES, DEVICE_MEMORY_BYTES),
        "memory_stats": lambda d=None: {},
        # The "CUDA" generator is the CPU generator (as the CPU compat layer does): seeding and state
        # snapshots round-trip, which is what Megatron's RNG tracker needs.
        "get_rng_state": lambda device="cuda": cpu_gen.get_state(),
        "set_rng_state": lambda new_state, device="cuda": cpu_gen.set_state(new_state),
        "get_rng_state_all": lambda: [cpu_gen.get_state()] * num_devices,
        "set_rng_state_all": lambda states: cpu_gen.set_state(states[0]),
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": lambda: cpu_gen.initial_seed(),
        "default_generators": tuple(cpu_gen for _ in range(num_devices)),
    }
    for name, value in stubs.items():
        patches.set(cuda, name, value)

    patches.set(torch.Tensor, "record_stream", record_stream)
    patches.set(torch.Tensor, "numpy", numpy_of_fakes(torch.Tensor.numpy))
    patches.set(nccl, "version", lambda: (2, 27, 3))  # logged by c10d for "nccl" groups
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "get_rng_state_all",
                 "set_rng_state_all", "seed", "seed_all", "initial_seed"):
        patches.set(cuda.random, name, stubs[name])
    _install_ipc_export(patches)


def _install_ipc_export(patches: _Patches) -> None:
    """``reduce_tensor`` of a fake cuda tensor: the 15 ``rebuild_cuda_tensor`` arguments of a real export,
    its handle naming the storage (a real one would be the allocation's cudaIpcMemHandle)."""
    original = reductions.reduce_tensor

    def reduce_tensor(tensor):
        if not (isinstance(tensor, FakeTensor) and tensor.device.type == "cuda"):
            return original(tensor)
        storage = tensor.untyped_storage()
        handle = f"fake-ipc:{storage._cdata}".encode()
        return (reductions.rebuild_cuda_tensor,
                (type(tensor), tensor.shape, tensor.stride(), tensor.storage_offset(), torch.storage.TypedStorage,
                 tensor.dtype, tensor.device.index, handle, storage.nbytes(), 0, tensor.requires_grad,
                 b"fake-ref-counter", 0, b"", False))

    patches.set(reductions, "reduce_tensor", reduce_tensor)


# ------------------------------------------------------------------------------ collective checker
@dataclass(frozen=True)
class Violation:
    collective: str
    backend: str
    devices: tuple[str, ...]
    call_site: str

    def __str__(self) -> str:
        return f"{self.collective} on a {self.backend} group with tensors on {list(self.devices)} at {self.call_site}"


_HARNESS_FILES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
                       for name in ("harness", "reads", "gaps"))


def _call_site() -> str:
    """The innermost frame that is neither torch, Megatron's comm helpers nor this harness."""
    frames = traceback.extract_stack()[:-1]
    skip = (os.sep + "torch" + os.sep, *_HARNESS_FILES, os.sep + "contextlib.py")
    for frame in reversed(frames):
        if not any(s in frame.filename for s in skip):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown>"


_CHECKED_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                        "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce", "gather",
                        "scatter", "all_to_all", "all_to_all_single", "send", "recv")


_GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base")


def _follow_gather(name: str, group, args, kwargs) -> None:
    """Known values through an all-gather: the fake world is symmetric (every rank contributes this rank's
    input), so the output of known inputs is known too (e.g. MoE token counts gathered over the EP group)."""
    try:
        bound = inspect.signature(getattr(dist.distributed_c10d, name)).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return
    output = bound.get("tensor_list", bound.get("output_tensor"))
    source = bound.get("tensor", bound.get("input_tensor"))
    if output is None or not isinstance(source, torch.Tensor):
        return
    size = dist.get_world_size(group if group is not None else dist.group.WORLD)
    follow_gather(output, [source], size, stacked=name != "all_gather")


def _group_arg(name: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]

    fn = getattr(dist.distributed_c10d, name)
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("group")


# ------------------------------------------------------------------------------------------ session
@dataclass
class FakeCudaSession:
    """State of one fake-CUDA rank; see the module docstring."""

    world_size: int
    rank: int
    num_devices: int
    violations: list[Violation] = field(default_factory=list)
    sent_messages: dict[str, list[bytes]] = field(default_factory=dict)
    missing_peer_messages: list[str] = field(default_factory=list)
    fake_mode: Any = None
    _backends: dict[int, str] = field(default_factory=dict)
    _peer: dict[str, list[bytes]] = field(default_factory=dict)
    _peer_pos: dict[str, int] = field(default_factory=dict)
    # Program-order events: ("collective", name, group ranks), ("sync", what), and whatever a test adds
    # with `note` (see the module docstring).
    trace: list[tuple] = field(default_factory=list)

    def note(self, *event) -> None:
        """Append a test's own event to this rank's trace (e.g. "bucket k packed")."""
        self.trace.append(tuple(event))

    def _collective(self, name: str, group) -> None:
        try:
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        except Exception:  # noqa: BLE001 (a group this rank is not in: the call itself will say so)
            return
        self.trace.append(("collective", name, ranks))

    @property
    def local_rank(self) -> int:
        return self.rank % self.num_devices

    def intended_backend(self, group=None) -> str:
        group = group if group is not None else dist.group.WORLD
        return self._backends.get(id(group), "nccl")

    def check(self) -> None:
        if self.violations:
            lines = "\n  ".join(str(v) for v in self.violations)
            raise CollectiveViolation(f"{len(self.violations)} collective(s) got non-CUDA tensors on NCCL groups:\n  "
                                      f"{lines}")

    # object-message streams, keyed by sender and group
    @staticmethod
    def _stream(src: int, group) -> str:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return f"{src}:{','.join(map(str, ranks))}"

    def add_peer_message(self, src: int, group_ranks, objects: list) -> None:
        """Queue what rank ``src`` broadcasts next to the group of ``group_ranks`` (e.g. a stand-in for a
        stage that is not run)."""
        buf = io.BytesIO()
        torch.save(list(objects), buf)
        self._peer.setdefault(f"{src}:{','.join(map(str, group_ranks))}", []).append(buf.getvalue())

    def _record(self, src: int, group, objects) -> None:
        buf = io.BytesIO()
        torch.save(list(objects), buf)
        self.sent_messages.setdefault(self._stream(src, group), []).append(buf.getvalue())

    def _replay(self, src: int, group, what: str):
        key = self._stream(src, group)
        pos = self._peer_pos.get(key, 0)
        stream = self._peer.get(key, [])
        self._peer_pos[key] = pos + 1
        if pos < len(stream):
            return torch.load(io.BytesIO(stream[pos]), weights_only=False)
        self.missing_peer_messages.append(f"{what} #{pos} from rank {src} (group {key}) at {_call_site()}")
        return None


_inside = threading.local()
_active = SimpleNamespace(session=None)  # the session of this process now (one at a time)
_wrappers: dict[str, Callable] = {}


def _wrap_collective(name: str, original: Callable) -> Callable:
    """One checked wrapper per collective for the process: Megatron binds some at import
    (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``), so a later session must reach the
    wrapper an earlier one installed; it reports to whichever session is active."""
    if name in _wrappers:
        return _wrappers[name]

    def checked(*args, **kwargs):
        session = _active.session
        if session is None or getattr(_inside, "active", False):  # torch re-enters with the public name
            return original(*args, **kwargs)
        group = _group_arg(name, args, kwargs)
        session._collective(name, group)
        backend = session.intended_backend(group)
        if backend == "nccl":
            devices = tuple(sorted({str(t.device) for t in _tensors_in(args, kwargs)}))
            if any(not d.startswith("cuda") for d in devices):
                session.violations.append(Violation(name, backend, devices, _call_site()))
        _inside.active = True
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.active = False
        if name in _GATHERS:
            _follow_gather(name, group, args, kwargs)
        return result

    _wrappers[name] = checked
    checked.__wrapped__ = original
    checked.__name__ = name
    return checked


def _install_dist(patches: _Patches, session: FakeCudaSession) -> None:
    c10d = dist.distributed_c10d
    original_new_group = c10d.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        intended = str(backend).lower() if backend is not None else "nccl"
        group = original_new_group(ranks=ranks, timeout=timeout, backend="fake", *args, **kwargs)
        if group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            session._backends[id(group)] = intended
        return group

    original_get_backend = c10d.get_backend

    def get_backend(group=None):
        original_get_backend(group)  # raises for a group this rank is not in
        return dist.Backend(session.intended_backend(group))

    for mod in (dist, c10d):
        patches.set(mod, "new_group", new_group)
        patches.set(mod, "get_backend", get_backend)
        for name in _CHECKED_COLLECTIVES:
            if hasattr(mod, name):
                patches.set(mod, name, _wrap_collective(name, getattr(c10d, name)))

    original_barrier = c10d.barrier

    def barrier(group=None, *args, **kwargs):
        session._collective("barrier", group)
        return original_barrier(group, *args, **kwargs)

    for mod in (dist, c10d):
        patches.set(mod, "barrier", barrier)

    original_batch = c10d.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            backend = session.intended_backend(op.group)
            if backend == "nccl" and op.tensor.device.type != "cuda":
                session.violations.append(Violation(f"batch_isend_irecv({op.op.__name__})", backend,
                                                    (str(op.tensor.device),), _call_site()))
        return original_batch(p2p_op_list)

    for mod in (dist, c10d):
        patches.set(mod, "batch_isend_irecv", batch_isend_irecv)

    @contextlib.contextmanager
    def one_by_one(group=None, device=None, async_ops=False):
        # The fake backend has no coalesced collectives: run the enclosed ones as they come.
        yield None

    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.distributed import param_and_grad_buffer  # binds the name at import time

    for mod in (c10d, dist, param_and_grad_buffer):
        patches.set(mod, "_coalescing_manager", one_by_one)

    # Object collectives, emulated symmetrically (see the module docstring).
    def my_group_rank(group) -> int:
        return dist.get_rank(group) if group is not None else session.rank

    def all_gather_object(object_list, obj, group=None):
        session._collective("all_gather_object", group)
        for i in range(len(object_list)):
            object_list[i] = obj

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        session._collective("gather_object", group)
        if object_gather_list is not None:
            for i in range(len(object_gather_list)):
                object_gather_list[i] = obj

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        session._collective("broadcast_object_list", group)
        src_global = src if src is not None else dist.get_global_rank(group, group_src)
        if src_global == session.rank:
            session._record(src_global, group, object_list)
            return
        received = session._replay(src_global, group, "broadcast_object_list")
        if received is not None:
            object_list[:] = received

    def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                            group_src=None):
        session._collective("scatter_object_list", group)
        src_global = src if src is not None else dist.get_global_rank(group, group_src)
        if src_global == session.rank:
            session._record(src_global, group, scatter_object_input_list)
            scatter_object_output_list[0] = scatter_object_input_list[my_group_rank(group)]
            return
        received = session._replay(src_global, group, "scatter_object_list")
        if received is not None:
            scatter_object_output_list[0] = received[my_group_rank(group)]

    for mod in (dist, c10d):
        patches.set(mod, "all_gather_object", all_gather_object)
        patches.set(mod, "gather_object", gather_object)
        patches.set(mod, "broadcast_object_list", broadcast_object_list)
        patches.set(mod, "scatter_object_list", scatter_object_list)


def _fake_mode_class():
    class _FakeMode(FakeTensorMode):
        # FakeTensorMode derives this from torch.cuda.is_available(), which the stubs make True; it must
        # stay True, or fake mode would try to initialise the (absent) CUDA runtime.
        avoid_device_init = True

    return _FakeMode


@contextlib.contextmanager
def fake_cuda(world_size: int, rank: int, *, num_devices: int = MAX_DEVICES,
              peer_messages: dict[str, list[bytes]] | None = None, check: bool = True) -> Iterator[FakeCudaSession]:
    """Be rank ``rank`` of a ``world_size`` NCCL world on fake GPUs, in this process (see the module docstring).

    On exit the process group and Megatron's parallel state are destroyed and the Python-level patches
    undone. With ``check`` (default) a collective violation raises :class:`CollectiveViolation` at exit.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}; allowed: 0..{world_size - 1}")
    if not 1 <= num_devices <= MAX_DEVICES:
        raise ValueError(f"num_devices {num_devices}: the fake device guard models 1..{MAX_DEVICES} devices")

    if getattr(cpu_compat, "_patched", False):
        raise RuntimeError("the CPU compat layer (megatron_arpo.device.cpu_compat) is active in this process; it maps "
                           "cuda to cpu, the fake CUDA harness the opposite. Run the harness in a fresh process")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; run the fake CUDA harness in a fresh "
                           "process")
    guard = load_guard()

    _FakeMode = _fake_mode_class()

    session = FakeCudaSession(world_size=world_size, rank=rank, num_devices=num_devices,
                              _peer=dict(peer_messages or {}))
    patches = _Patches()
    device = _DeviceState(index=rank % num_devices)
    modes = contextlib.ExitStack()
    try:
        _install_cuda_stubs(patches, device, num_devices, guard, session.trace)
        guard.set_device(device.index)
        _install_dist(patches, session)
        install_megatron_gaps(patches)
        install_host_io(patches)
        install_module_moves(patches)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        session._backends[id(dist.group.WORLD)] = "nccl"
        _active.session = session
        session.fake_mode = _FakeMode(allow_non_fake_inputs=True)
        modes.enter_context(session.fake_mode)
        modes.enter_context(DataReadMode())  # dispatch level: autograd's device threads see it too
        modes.enter_context(HostFunctionMode())
        yield session
    finally:
        _active.session = None
        modes.close()
        try:
            if "megatron.core.parallel_state" in sys.modules:
                sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
            reset_megatron_globals()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            patches.undo()
            guard.set_device(0)
    if check:
        session.check()
