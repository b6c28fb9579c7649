"""Build pycomm._C with torch's cpp_extension (ninja, parallel).

Install with `pip install --no-build-isolation -e .` so pip builds against the
torch already installed instead of fetching another one.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    # Every layer's C++ (kernels, transport, algorithms, backend); only
    # csrc/backend/ includes torch headers.
    files = []
    for layer in ("common", "kernels/cpu", "transport", "algorithms", "backend"):
        files += sorted(glob.glob(os.path.join("csrc", layer, "*.cc")))
    return files


setup(
    name="pycomm",
    version="0.1.0",
    description="Collective communication for PyTorch: a torch.distributed backend "
    "with ring/tree/sharded all-reduce",
    packages=find_packages(include=["pycomm", "pycomm.*"]),
    python_requires=">=3.9",
    install_requires=["torch", "numpy", "scikit-learn", "pyyaml", "tqdm", "matplotlib"],
    ext_modules=[
        CppExtension(
            name="pycomm._C",
            sources=sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={
        "console_scripts": [
            "pycomm-bench=pycomm.bench:main",
            "pycomm-train=pycomm.train.cli:main",
        ]
    },
)
