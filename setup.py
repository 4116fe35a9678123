"""Build kvkernels._C: op schemas + C++ CPU ops always; CUDA kernels when a CUDA torch and toolkit exist.

KVKERNELS_CUDA=0/1 overrides the detection. TORCH_CUDA_ARCH_LIST defaults to sm_80, sm_87 (Jetson Orin), sm_90.
Build with `pip install --no-build-isolation -e .` so pip does not fetch a second (CUDA) torch.
"""

import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;8.7;9.0"


def cuda_toolkit_problem() -> str | None:
    """Why the CUDA kernels cannot be built here, or None. torch guesses CUDA_HOME from `which nvcc`, which is wrong
    when nvcc is a wrapper outside the toolkit (e.g. /usr/local/bin/nvcc gives /usr/local): check the headers."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    home = cpp_extension.CUDA_HOME
    if home is None:
        return "no CUDA toolkit found (set CUDA_HOME)"
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return f"CUDA_HOME={home} has no include/cuda_runtime.h (set CUDA_HOME to the toolkit root)"
    return None


def want_cuda() -> bool:
    forced = os.environ.get("KVKERNELS_CUDA")
    if forced == "0":
        return False
    problem = cuda_toolkit_problem()
    if forced == "1" and problem:
        raise SystemExit(f"kvkernels: KVKERNELS_CUDA=1 but the CUDA kernels cannot be built: {problem}")
    if problem:
        print(f"kvkernels: no CUDA kernels: {problem}")
    return problem is None


def extension():
    include_dirs = [os.path.join(ROOT, "csrc")]
    sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    # -ffp-contract=off: the CPU lattice kernels are bit-identical to the reference only without fused multiply-adds
    cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off"]
    if not want_cuda():
        print("kvkernels: building the C++ extension without CUDA kernels")
        return cpp_extension.CppExtension(
            "kvkernels._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags}
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    print(f"kvkernels: building CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(
        "kvkernels._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + ["-DKVKERNELS_WITH_CUDA"], "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
