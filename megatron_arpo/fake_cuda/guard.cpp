// Fake CUDA device support for a CPU-only torch build: used by megatron_arpo/fake_cuda/harness.py (the fake-CUDA tier and plan --measure).
//
// Only FakeTensorMode tensors ever live on "cuda" with this loaded: nothing here allocates device memory or
// runs a kernel. A CPU-only libtorch lacks two things that fake cuda tensors still need:
//
// 1. A device guard for DeviceType::CUDA. Indexing, .cuda(), .to("cuda"), autograd's backward and a
//    requires_grad cuda leaf all open a DeviceGuard; without an implementation they raise (or abort).
//    c10's FakeGuardImpl (a mutable current device and stream ids, eight devices) is registered for CUDA.
// 2. CUDA hooks that say CUDA is there: isBuilt() (at::accelerator::getAccelerator() picks CUDA, and the
//    autograd engine asks the current accelerator for streams of cuda inputs), hasCUDA(), and
//    hasPrimaryContext() (the engine checks it before running a device's backward work). getCUDAHooks() builds
//    its object once (a default CUDAHooksInterface) and keeps a static reference, usually before any
//    extension is loaded, so a registry entry would come too late. The cached object is re-typed in place:
//    FakeCUDAHooks adds no data member (static_assert below), so placement-new only swaps the vtable
//    pointer, and every later call through the cached reference sees hasCUDA() == true.
//
// Everything else keeps CUDAHooksInterface's defaults (they raise "needs ATen_cuda"), so a code path that
// would really touch a GPU still fails loudly.
#include <new>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/extension.h>

namespace {

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  // The autograd engine asks before it runs a device's backward work (nothing to initialise here).
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
static_assert(sizeof(FakeCUDAHooks) == sizeof(at::CUDAHooksInterface),
              "FakeCUDAHooks must not add state: it is constructed over the cached hooks object");

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

bool install_hooks() {
  auto& hooks = const_cast<at::CUDAHooksInterface&>(at::detail::getCUDAHooks());
  if (!hooks.hasCUDA()) {
    new (&hooks) FakeCUDAHooks();  // same storage, new dynamic type (see the header comment)
  }
  return at::detail::getCUDAHooks().hasCUDA();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install_hooks", &install_hooks, "make getCUDAHooks().hasCUDA() answer true; returns the new answer");
  // torch.cuda.set_device is a Python stub; C++ (Tensor.cuda() without an index, DeviceGuard) asks the guard.
  m.def("set_device", [](int64_t index) {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index)));
  });
  m.def("guard_registered", [] { return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA); });
}
