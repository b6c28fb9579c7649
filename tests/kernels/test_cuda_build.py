"""The CUDA build, checked on a machine without a GPU.

* csrc/backend/*.cc with CUDA-only code (cuda_*.cc, #ifdef PYCOMM_WITH_CUDA) compile with PYCOMM_WITH_CUDA
  defined, against torch's headers (the c10/cuda ones ship with the CPU wheel too)
  and the CUDA toolkit's, with g++ -fsyntax-only: the code that only a CUDA build
  compiles cannot rot unseen (all of them in one translation unit first, each alone if
  that fails). Skipped when nvcc's toolkit headers or torch's c10/cuda headers are
  absent. (The kernels themselves: tests/kernels/test_kernels.py.)
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
    """Every BACKEND_SOURCES file through g++ -fsyntax-only with PYCOMM_WITH_CUDA: name ->
    CompletedProcess, or a str saying why skipped. Most of each check is parsing torch's and
    CUDA's headers, so the files are first checked together as one
    translation unit that includes each (about the time of one file); only when that fails
    or warns is each file checked alone, two at a time, so a failure names its file and a
    clash between two files' internal names does not fail them. (What one file alone would
    miss here: a header it uses but only an earlier file includes. The CUDA build itself,
    benchmarks/gpu_check.sh, compiles each file on its own.)"""
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

    def check(source):
        # the verdict is kept per content of the source and the headers it includes, g++'s
        # and nvcc's versions (the toolkit's headers) and torch's version (its headers)
        return cpp_build.cached_check(base + [source], [source], tools=[cxx, nvcc],
                                      extra_key=torch.__version__, timeout=600)

    return together_then_alone(BACKEND_SOURCES, check, cpp_build.cache_dir())


def together_then_alone(names, check, folder):
    """check(path) of one file under `folder` that #includes each of csrc/backend/<names>; when
    that passes without a warning, its result stands for every name; otherwise each file's
    own check(csrc/backend/<name>), two at a time: name -> result."""
    unity = os.path.join(folder, "cuda-backend-together.cc")
    text = "".join(f'#include "backend/{name}"\n' for name in names)
    if not os.path.exists(unity) or open(unity).read() != text:
        tmp = f"{unity}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, unity)
    together = check(unity)
    if together.returncode == 0 and "warning" not in together.stderr.lower():
        return {name: together for name in names}

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(check, [os.path.join(ROOT, "csrc", "backend", n) for n in names])))


def test_a_failure_together_checks_each_file_alone(tmp_path):
    """The files are checked alone when the check of all of them together fails or warns
    (a failure then names its file; a clash of two files' names fails neither), and only then."""
    names = ["a.cc", "b.cc"]

    def fake(outcomes):
        calls = []

        def check(path):
            calls.append(os.path.basename(path))
            rc, err = outcomes[os.path.basename(path)]
            return subprocess.CompletedProcess([path], rc, "", err)
        return check, calls

    check, calls = fake({"cuda-backend-together.cc": (0, "")})
    got = together_then_alone(names, check, str(tmp_path))
    assert calls == ["cuda-backend-together.cc"] and set(got) == set(names)
    assert open(tmp_path / "cuda-backend-together.cc").read() == '#include "backend/a.cc"\n#include "backend/b.cc"\n'
    for together in [(1, "b.cc:3: error: redefinition"), (0, "a.cc:9: warning: unused")]:
        check, calls = fake({"cuda-backend-together.cc": together, "a.cc": (0, ""), "b.cc": (1, "b.cc:3: error")})
        got = together_then_alone(names, check, str(tmp_path))
        assert sorted(calls) == ["a.cc", "b.cc", "cuda-backend-together.cc"]
        assert (got["a.cc"].returncode, got["b.cc"].returncode) == (0, 1)


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


def _compiled(files):
    """setup.py's sources with each generated unity unit (build/unity/*.cc) replaced by the
    csrc/ files it includes."""
    out = []
    for f in files:
        if f.startswith(os.path.join("build", "unity") + os.sep):
            with open(os.path.join(ROOT, f)) as unit:
                out += ["csrc/" + line.split('"')[1] for line in unit if line.startswith("#include")]
        else:
            out.append(f)
    return out


def test_cpu_build_leaves_out_cuda_sources():
    """The CPU build's sources, with the unity build on (the default), off, and a bad value."""
    code = ("import json, os, runpy, sys; os.environ['PYCOMM_BUILD_CUDA'] = '0'; "
            "import setuptools; setuptools.setup = lambda **kw: None; "
            "g = runpy.run_path('setup.py'); out = {}\n"
            "for knob in ('1', '0', 'maybe'):\n"
            "    os.environ['PYCOMM_UNITY_BUILD'] = knob\n"
            "    try: out[knob] = g['sources']()\n"
            "    except SystemExit as e: out[knob] = str(e)\n"
            "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    backend = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "backend", "*.cc"))
                     if not os.path.basename(p).startswith("cuda_"))
    for knob in ("1", "0"):
        files = _compiled(got[knob])
        assert "csrc/backend/process_group.cc" in files
        assert not [f for f in files if f.endswith(".cu") or os.path.basename(f).startswith("cuda_")], files
        # every backend file once, the torch-free layers as files of their own
        assert sorted(f for f in files if f.startswith("csrc/backend/")) == backend, files
        assert len(files) == len(set(files))
        assert "csrc/transport/tcp.cc" in got[knob] and "csrc/kernels/cpu/reduce.cc" in got[knob]
    # unity: the pybind11 files in one unit, the rest in another; off: each file listed
    assert sorted(got["1"][-2:]) == ["build/unity/backend_bindings.cc", "build/unity/backend_core.cc"], got["1"]
    assert sorted(_compiled(["build/unity/backend_bindings.cc"])) == [
        "csrc/backend/bindings.cc", "csrc/backend/kernel_bindings.cc"]
    assert not [f for f in got["1"] if f.startswith("csrc/backend/")], got["1"]
    assert [f for f in got["0"] if f.startswith("csrc/backend/")] == backend
    assert got["maybe"] == "PYCOMM_UNITY_BUILD must be 0 or 1 (got 'maybe')"


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
    # the CUDA-only files compile alone, outside the backend's unity units
    assert {"csrc/kernels/cuda/reduce.cu", "csrc/kernels/cuda/topk.cu", "csrc/kernels/cuda/quantize.cu",
            "csrc/backend/cuda_staging.cc", "csrc/backend/cuda_kernel_bindings.cc"} <= sources, sources
    assert "csrc/backend/process_group.cc" in _compiled(ext["sources"])
    assert ["PYCOMM_WITH_CUDA", "1"] in ext["macros"]
    assert "nvcc" in ext["args"] and "cxx" in ext["args"]
