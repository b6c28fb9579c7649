"""The CUDA build, checked on a machine without a GPU.

* csrc/backend/*.cc with CUDA-only code (cuda_*.cc, #ifdef PYCOMM_WITH_CUDA) compile with PYCOMM_WITH_CUDA
  defined, against torch's headers (the c10/cuda ones ship with the CPU wheel too)
  and the CUDA toolkit's, with g++ -fsyntax-only: the code that only a CUDA build
  compiles cannot rot unseen. Skipped when nvcc's toolkit headers or torch's
  c10/cuda headers are absent. (The kernels themselves: tests/kernels/test_kernels.py.)
* setup.py's choice of build: PYCOMM_BUILD_CUDA=1 with a CPU torch fails clearly;
  the CPU build's sources leave out every CUDA file.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

import pycomm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_include_dir():
    """The toolkit include directory nvcc itself uses (nvcc may be a wrapper script)."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if nvcc is None:
        return None
    proc = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True,
                          text=True, timeout=60)
    for line in (proc.stdout + proc.stderr).splitlines():
        if "INCLUDES=" in line:
            for flag in line.split("INCLUDES=", 1)[1].strip().strip('"').split():
                path = flag[2:] if flag.startswith("-I") else flag
                path = path.strip('"')
                if os.path.exists(os.path.join(path, "cuda_runtime_api.h")):
                    return path
    return None


# The backend files with CUDA-only code: the cuda_*.cc, and files with #if(def) PYCOMM_WITH_CUDA
# blocks (a file that only names the macro in a comment compiles the same either way).
_CUDA_BLOCK = re.compile(r"^\s*#\s*(?:if|ifdef|elif)\b.*\bPYCOMM_WITH_CUDA\b", re.MULTILINE)
BACKEND_SOURCES = sorted(
    os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "csrc", "backend", "*.cc"))
    if _CUDA_BLOCK.search(open(p).read()) or os.path.basename(p).startswith("cuda_"))


def test_cuda_backend_sources_exist():
    # process_group.cc has no CUDA-only code since the device seam (device_seam.h): CUDA
    # staging is a seam cuda_staging.cc registers
    assert {"cuda_staging.cc", "cuda_kernel_bindings.cc", "kernel_bindings.cc",
            "bindings.cc"} <= set(BACKEND_SOURCES), BACKEND_SOURCES
    assert "process_group.cc" not in BACKEND_SOURCES, BACKEND_SOURCES


@pytest.fixture(scope="module")
def cuda_syntax_checks():
    """Every BACKEND_SOURCES file through g++ -fsyntax-only with PYCOMM_WITH_CUDA, two at a time
    (this machine's 2 cores; ~15 s each): name -> CompletedProcess, or a str saying why skipped."""
    from torch.utils.cpp_extension import include_paths

    cuda_include = cuda_include_dir()
    if cuda_include is None:
        return "no CUDA toolkit headers (nvcc not found) - CUDA backend not compile-checked"
    torch_includes = include_paths()
    if not any(os.path.exists(os.path.join(p, "c10", "cuda", "CUDAStream.h")) for p in torch_includes):
        return "this torch ships no c10/cuda headers - CUDA backend not compile-checked"
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        return "no g++ on PATH"
    base = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter",
            "-DPYCOMM_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
            # the CPU wheel lacks the generated cuda_cmake_macros.h (export macros only)
            "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
            "-I", os.path.join(ROOT, "csrc")]
    for p in torch_includes + [sysconfig.get_paths()["include"], cuda_include]:
        base += ["-isystem", p]

    import cpp_build

    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"

    def check(name):
        # the verdict is kept per content of the source and the headers it includes, g++'s
        # and nvcc's versions (the toolkit's headers) and torch's version (its headers)
        source = os.path.join(ROOT, "csrc", "backend", name)
        return cpp_build.cached_check(base + [source], [source], tools=[cxx, nvcc],
                                      extra_key=torch.__version__, timeout=600)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(BACKEND_SOURCES, pool.map(check, BACKEND_SOURCES)))


@pytest.mark.parametrize("name", BACKEND_SOURCES)
def test_backend_compiles_with_cuda_defined(name, cuda_syntax_checks):
    """g++ -std=c++17 -fsyntax-only -DPYCOMM_WITH_CUDA -Icsrc <torch includes> <cuda include> csrc/backend/<name>"""
    if isinstance(cuda_syntax_checks, str):
        pytest.skip(cuda_syntax_checks)
    proc = cuda_syntax_checks[name]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-6000:]


def setup_py(env_value):
    env = dict(os.environ, PYCOMM_BUILD_CUDA=env_value)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch is a CUDA build here")
def test_forcing_cuda_with_cpu_torch_fails_clearly():
    proc = setup_py("1")
    assert proc.returncode != 0
    assert "PYCOMM_BUILD_CUDA=1 but torch is a CPU build" in proc.stderr


def test_bad_build_knob_is_rejected():
    proc = setup_py("maybe")
    assert proc.returncode != 0
    assert "PYCOMM_BUILD_CUDA must be auto, 0 or 1" in proc.stderr


def test_cpu_build_leaves_out_cuda_sources():
    code = ("import os, runpy, sys; os.environ['PYCOMM_BUILD_CUDA'] = '0'; "
            "import setuptools; setuptools.setup = lambda **kw: None; "
            "g = runpy.run_path('setup.py'); print('\\n'.join(g['sources']()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = proc.stdout.split()
    assert "csrc/backend/process_group.cc" in files
    assert not [f for f in files if f.endswith(".cu") or os.path.basename(f).startswith("cuda_")], files


def test_cuda_available_agrees_with_build():
    assert pycomm.built_with_cuda() == (torch.version.cuda is not None and pycomm._C._built_with_cuda())
    assert pycomm.cuda_available() == (pycomm.built_with_cuda() and torch.cuda.is_available())
    devices = torch.distributed.Backend.backend_capability["pycomm"]
    assert devices == (["cpu", "cuda"] if pycomm.built_with_cuda() else ["cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the benchmark would run")
def test_cuda_benchmark_without_gpu_exits_with_a_message():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels_cuda.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kernels_cuda: no CUDA device visible to torch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cuda_build_selected_when_torch_has_cuda():
    """setup.py's CUDA branch, exercised here by pretending torch is a CUDA build: the
    extension gains every .cu and cuda_*.cc file and the PYCOMM_WITH_CUDA macro."""
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        pytest.skip("no CUDA toolkit (nvcc not found)")
    cuda_home = os.path.dirname(cuda_include.rstrip("/"))
    code = f"""
import json, os, runpy, setuptools, torch, torch.utils.cpp_extension as ext
torch.version.cuda = "13.0"
ext.CUDA_HOME = {cuda_home!r}
os.environ["PYCOMM_BUILD_CUDA"] = "auto"
seen = {{}}
setuptools.setup = lambda **kw: seen.update(kw)
runpy.run_path("setup.py", run_name="__main__")
e = seen["ext_modules"][0]
print(json.dumps({{"sources": e.sources, "macros": e.define_macros, "args": e.extra_compile_args}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    ext = json.loads(proc.stdout.strip().splitlines()[-1])
    sources = set(ext["sources"])
    assert {"csrc/kernels/cuda/reduce.cu", "csrc/kernels/cuda/topk.cu", "csrc/kernels/cuda/quantize.cu",
            "csrc/backend/cuda_staging.cc", "csrc/backend/cuda_kernel_bindings.cc",
            "csrc/backend/process_group.cc"} <= sources, sources
    assert ["PYCOMM_WITH_CUDA", "1"] in ext["macros"]
    assert "nvcc" in ext["args"] and "cxx" in ext["args"]
