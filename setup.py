from setuptools import find_packages, setup

setup(
    name="megatron-tsp",
    version="0.1.0",
    description="Tensor + Sequence Parallelism (TSP) for Megatron-LM / megatron-core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tsp", "megatron_tsp.*"]),
    package_data={
        "megatron_tsp": ["models/*.json"],
        "megatron_tsp.tools.estimator": ["hardware/*.json"],
    },
    include_package_data=True,
    # Tested: megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12) with torch 2.13.0.
    # Install torch yourself first (CPU wheel, or the CUDA build your cluster uses): an unpinned
    # torch requirement would pull a multi-GB CUDA build. Transformer Engine and NVIDIA apex are
    # optional GPU extras imported lazily by megatron-core; never install the PyPI "apex".
    # torch >= 2.10 accumulates bf16 GEMMs into fp32 buffers in place on CUDA; 2.4-2.9 take a
    # slower fallback (megatron_tsp/core/layers/precision.py).
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "packaging",
    ],
    extras_require={
        "plot": ["matplotlib"],
        # Hugging Face checkpoint directories (megatron_tsp/models/hf_import.py): safetensors
        # slices, tokenizer.json; transformers only for the tests' reference models.
        "hf": ["safetensors>=0.4", "tokenizers>=0.19"],
        "test": [
            "pytest",
            "matplotlib",
            "psutil",
            "transformers==5.25.0",
            "safetensors==0.8.0",
            "huggingface_hub==2.4.0",
            "tokenizers==0.23.3",
            # Megatron-LM's pretrain_gpt.py (megatron.training) imports these; triton has no
            # torch requirement (constraints-cpu.txt pins it)
            "six",
            "regex",
            "pyyaml",
            "pydantic",
            "triton",
        ],
    },
    entry_points={
        "console_scripts": [
            "megatron-tsp=megatron_tsp.tools.cli:main",
            "megatron-tsp-launch=megatron_tsp.megatron_lm.launch:main",
            "megatron-tsp-compare=megatron_tsp.megatron_lm.compare:main",
            "megatron-tsp-config=megatron_tsp.megatron_lm.configs:main",
        ]
    },
)
