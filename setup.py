"""Build pycomm._C with torch's cpp_extension (ninja, parallel).

Install with `pip install --no-build-isolation -e .` so pip builds against the
torch already installed instead of fetching another one.

CUDA: when the installed torch is a CUDA build (torch.version.cuda) and nvcc is
found (CUDA_HOME), pycomm._C is a CUDAExtension that adds csrc/kernels/cuda/*.cu
and csrc/backend/cuda_*.cc and defines PYCOMM_WITH_CUDA; otherwise it is the CPU
CppExtension, unchanged. PYCOMM_BUILD_CUDA=0 forces the CPU build, =1 makes a
missing CUDA toolchain an error. pycomm.built_with_cuda() tells which was built.

Incremental: objects live in build/temp-<torch>-<cpu|cuda>/ (not pip's fresh temporary
folder), so ninja recompiles only what changed and `pip install -e .` after a one-line
change, or a second `make install`, compiles nothing; torch wraps the compiler in ccache
where it is installed. A --build-temp given on the command line (make asan-build) wins.

Sanitizers: PYCOMM_SANITIZE=address,undefined (any -fsanitize= list) builds with
those sanitizers at -O1 -g1 with frame pointers. Build it apart from the normal
extension (`make test-asan` does: --build-temp/--build-lib under build-asan/) and
load it into an unsanitized python with LD_PRELOAD=$(g++ -print-file-name=libasan.so).
"""
import glob
import os

# This script imports torch, whose autoload would load the pycomm._C being rebuilt here
# (pycomm_autoload): a loaded library overwritten in place can crash the process.
os.environ["PYCOMM_AUTOLOAD"] = "0"

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    knob = os.environ.get("PYCOMM_BUILD_CUDA", "auto").strip().lower()
    if knob not in ("auto", "0", "1"):
        raise SystemExit(f"PYCOMM_BUILD_CUDA must be auto, 0 or 1 (got {knob!r})")
    if knob == "0":
        return False
    have = torch.version.cuda is not None and CUDA_HOME is not None
    if knob == "1" and not have:
        raise SystemExit(
            "PYCOMM_BUILD_CUDA=1 but "
            + ("torch is a CPU build" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)")
        )
    return have


WITH_CUDA = want_cuda()


def sources():
    # Every layer's C++ (kernels, transport, algorithms, backend); only
    # csrc/backend/ includes torch headers. csrc/backend/cuda_*.cc and
    # csrc/kernels/cuda/*.cu are compiled only into the CUDA build.
    files = []
    for layer in ("common", "kernels/cpu", "transport", "algorithms", "backend"):
        for path in sorted(glob.glob(os.path.join("csrc", layer, "*.cc"))):
            if WITH_CUDA or not os.path.basename(path).startswith("cuda_"):
                files.append(path)
    if WITH_CUDA:
        files += sorted(glob.glob(os.path.join("csrc", "kernels", "cuda", "*.cu")))
    return files


def sanitize_flags():
    """-fsanitize=... for PYCOMM_SANITIZE (e.g. "address,undefined"), or [] when unset."""
    knob = os.environ.get("PYCOMM_SANITIZE", "").strip().replace(" ", "")
    if not knob:
        return []
    for name in knob.split(","):
        if not name or not all(c.isalnum() or c in "-_" for c in name):
            raise SystemExit(f"PYCOMM_SANITIZE must be a comma-separated list of sanitizers (got {knob!r})")
    return [f"-fsanitize={knob}"]


SANITIZE = sanitize_flags()
# -g1 (line tables: a backtrace or a sanitizer report names the file and line, inlined
# frames too) over the -g that python's flags bring: full debug info of torch's headers
# made each backend file compile 1.4-1.6x (1.8x sanitized) slower
# (benchmarks/results/suite_durations.md). Sanitized builds: -O1 keeps the build fast.
CXX_FLAGS = ["-O1" if SANITIZE else "-O3", "-g1", "-std=c++17", "-Wall", "-Wno-unused-parameter"]
if SANITIZE:
    CXX_FLAGS += SANITIZE + ["-fno-omit-frame-pointer"]


# OpenSSL's libcrypto: the TCP transport's SHA-256, HMAC, HKDF, PBKDF2, constant-time
# compare and random bytes (csrc/transport/hmac.h). Headers from libssl-dev (Debian).
LIBRARIES = ["crypto"]


def extension():
    if not WITH_CUDA:
        return CppExtension(
            name="pycomm._C",
            sources=sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=CXX_FLAGS,
            extra_link_args=SANITIZE,
            libraries=LIBRARIES,
        )
    # Architectures: torch's TORCH_CUDA_ARCH_LIST (default: the visible GPUs).
    return CUDAExtension(
        name="pycomm._C",
        sources=sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[("PYCOMM_WITH_CUDA", "1")],
        extra_link_args=SANITIZE,
        libraries=LIBRARIES,
        extra_compile_args={
            "cxx": CXX_FLAGS,
            "nvcc": ["-O3", "-std=c++17", "-Xcompiler", "-Wall", "-Xcompiler", "-Wno-unused-parameter"],
        },
    )


class Build(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension with objects in a build folder of our own that outlives pip's
    temporary one (pip -e points build_temp at a fresh folder on every install)."""

    def finalize_options(self):
        explicit = self.build_temp is not None  # --build-temp on the command line
        super().finalize_options()
        if not explicit and not SANITIZE:
            kind = "cuda" if WITH_CUDA else "cpu"
            self.build_temp = os.path.join(ROOT, "build", f"temp-{torch.__version__}-{kind}")


setup(
    name="pycomm",
    version="0.1.0",
    description="Collective communication for PyTorch: a torch.distributed backend "
    "with ring/tree/sharded all-reduce",
    packages=find_packages(include=["pycomm", "pycomm.*", "pycomm_autoload"]),
    python_requires=">=3.9",
    install_requires=["torch", "numpy", "scikit-learn", "pyyaml", "tqdm", "matplotlib"],
    ext_modules=[extension()],
    cmdclass={"build_ext": Build},
    entry_points={
        "console_scripts": [
            "pycomm-bench=pycomm.bench:main",
            "pycomm-train=pycomm.train.cli:main",
        ],
        # torch calls it at `import torch` (device-backend autoload): registers the
        # "pycomm" backend without `import pycomm` (pycomm_autoload/__init__.py)
        "torch.backends": [
            "pycomm=pycomm_autoload:register",
        ],
    },
)
