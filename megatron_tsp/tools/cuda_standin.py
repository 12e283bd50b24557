"""A stand-in CUDA device for CPU-only torch, so autograd runs on CUDA-device fake tensors.

``FakeTensorMode`` runs a CUDA model's forward on shape-only ``device="cuda"`` tensors even in a
CPU-only torch build, but the autograd engine aborts: it asks the device-guard registry for the
CUDA guard (``InputMetadata`` records every tensor's stream) and the accelerator hooks for the
current CUDA stream (``InputBuffer::add``), and a CPU build registers neither. torch's own remedy,
``torch._C._ensureCUDADeviceGuardSet`` (called by ``FakeTensorMode.__enter__``), only swaps the
guard of a CUDA build that sees no GPU; it does nothing in a CPU build. There is no Python API to
register a guard for the CUDA device type (``torch._C._acc`` and
``torch.utils.backend_registration`` cover only PrivateUse1).

The working mechanism: a ~15-line C++ shim, compiled here with the system C++ compiler against
torch's bundled headers (~2 s, cached per torch version) and loaded with ``ctypes``, registers

* c10's ``FakeGuardImpl<CUDA>`` (a no-op guard that tracks a current device and stream index) in
  the device-guard registry for ``DeviceType::CUDA``;
* a ``CUDAHooksInterface`` under the registry key torch looks up for CUDA hooks, which reports
  CUDA built/available only while :func:`active` is on (then ``at::getAccelerator()`` answers
  CUDA and the engine's stream bookkeeping goes through the no-op guard).

torch reads the CUDA hooks once, while ``import torch`` initialises its C module, so the shim
must be loaded *before torch is imported*: :func:`load` refuses otherwise. This module therefore
imports nothing from torch; the traffic benchmark loads it first in a fresh interpreter. No
kernel ever runs on the stand-in: every CUDA tensor in such a process is a fake tensor. A CUDA
build of torch (``libc10_cuda.so`` present) gets nothing loaded: its own guard and hooks serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from typing import Optional

SOURCE = r"""
#include <atomic>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
std::atomic<bool> active{false};

// A no-op guard for the CUDA device type (the registry holds a pointer for the process' life).
const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> cuda_guard;
const c10::impl::DeviceGuardImplRegistrar cuda_guard_registrar(c10::DeviceType::CUDA, &cuda_guard);

// CUDA hooks that claim a device only while the recorder is on.
struct StandinCUDAHooks : at::CUDAHooksInterface {
  explicit StandinCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return active.load(); }
  bool isAvailable() const override { return active.load(); }
  bool hasCUDA() const override { return active.load(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return active.load(); }
  c10::DeviceIndex deviceCount() const override { return active.load() ? 1 : 0; }
};
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", StandinCUDAHooks)
}

extern "C" void megatron_tsp_cuda_standin_set_active(int on) { active.store(on != 0); }
"""

_LIB: Optional[ctypes.CDLL] = None
_NATIVE = False  # a CUDA build of torch: its own guard and hooks serve, nothing is loaded


class StandinUnavailable(RuntimeError):
    """The stand-in cannot be built or loaded in this process."""


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise StandinUnavailable("torch is not installed")
    return list(spec.submodule_search_locations)[0]


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_tsp")


def build(torch_dir: Optional[str] = None) -> str:
    """Compile the shim (once per torch installation and source); return the library path."""
    torch_dir = torch_dir or _torch_dir()
    include, lib = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    if not os.path.isdir(include):
        raise StandinUnavailable(f"torch's C++ headers are missing ({include})")
    key = hashlib.sha256((SOURCE + torch_dir + str(os.path.getmtime(lib))).encode()).hexdigest()
    out_dir = _cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"cuda_standin_{key[:16]}.so")
    if os.path.exists(path):
        return path
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src, tmp_out = os.path.join(tmp, "standin.cpp"), os.path.join(tmp, "standin.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        cmd = [compiler, "-O1", "-std=c++20", "-shared", "-fPIC", "-w", "-I" + include, src]
        cmd += ["-o", tmp_out, "-L" + lib, "-lc10", "-ltorch_cpu", "-Wl,-rpath," + lib]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except FileNotFoundError as exc:
            raise StandinUnavailable(f"no C++ compiler ({compiler}): {exc}") from exc
        if proc.returncode != 0:
            raise StandinUnavailable(f"compiling the CUDA stand-in failed:\n{proc.stderr[-3000:]}")
        os.replace(tmp_out, path)  # atomic: concurrent builders never load a partial file
    return path


def load() -> None:
    """Load the shim into this process (before ``import torch``); idempotent."""
    global _LIB, _NATIVE
    if _LIB is not None or _NATIVE:
        return
    if "torch" in sys.modules:
        raise StandinUnavailable(
            "the CUDA stand-in must be loaded before torch is imported (torch reads its CUDA "
            "hooks once, at import); run the measurement in a fresh interpreter"
        )
    torch_dir = _torch_dir()
    if os.path.exists(os.path.join(torch_dir, "lib", "libc10_cuda.so")):
        # Registering a second CUDA guard would replace the real one: use torch's own.
        _NATIVE = True
        return
    path = build(torch_dir)
    for name in ("libc10.so", "libtorch_cpu.so"):  # the shim's dependencies, torch's copies
        ctypes.CDLL(os.path.join(torch_dir, "lib", name), mode=ctypes.RTLD_GLOBAL)
    _LIB = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def loaded() -> bool:
    return _LIB is not None or _NATIVE


def set_active(on: bool) -> None:
    if _NATIVE:
        return
    if _LIB is None:
        raise StandinUnavailable("the CUDA stand-in is not loaded (call load() before torch)")
    _LIB.megatron_tsp_cuda_standin_set_active(1 if on else 0)


@contextlib.contextmanager
def active():
    """The stand-in CUDA device is visible (``at::getAccelerator()`` is CUDA) inside."""
    set_active(True)
    try:
        yield
    finally:
        set_active(False)
