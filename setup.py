"""megatron-k3: a pretraining stack for the Kimi K3 architecture on megatron-core."""
from pathlib import Path

from setuptools import find_packages, setup


def _reqs(name):
    out = []
    for line in Path(__file__).with_name(name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-r"):
            out.append(line)
    return out


setup(
    name="megatron-k3",
    version="0.1.0",
    description="Kimi K3 architecture pretraining on megatron-core",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_k3", "megatron_k3.*", "checkpoints_io", "checkpoints_io.*"]),
    package_data={"megatron_k3.optim": ["host_adamw.c"]},  # built at first use (optim/host_kernel.py)
    install_requires=_reqs("requirements.txt"),
    entry_points={"console_scripts": ["megatron-k3=megatron_k3.__main__:main"]},  # megatron-k3 <command> ...
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "dali": ["nvidia-dali-cuda130==2.4.0"],
        "eval": ["transformers==5.23.0", "safetensors==0.8.0", "lm-eval==0.4.13", "accelerate==1.15.0"],
        "dev": ["pytest==9.2.0"],
    },
)
