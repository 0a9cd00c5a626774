"""megatron_lev: pre-training stack for Leviathan (LEV input embeddings) language models.

The metadata lives here; pyproject.toml only names the build backend.
"""
from setuptools import find_namespace_packages, setup

setup(
    name="megatron_lev",
    version="0.1.0",
    description="Leviathan language models: LEV embedding generator on megatron-core + DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Namespace discovery: the data folders (configs/, deepspeed_configs/) are packages of data,
    # which setuptools otherwise warns about on every install.
    packages=find_namespace_packages(include=["megatron_lev", "megatron_lev.*"], exclude=["*.__pycache__"]),
    # YAML configs live inside the package so an installed package finds them.
    # So are the DeepSpeed JSONs (`deepspeed_configs/` in a checkout links to them).
    package_data={"megatron_lev": ["configs/*.yaml", "configs/**/*.yaml", "deepspeed_configs/*.json", "hf/*.py"]},
    include_package_data=True,
    install_requires=[
        # A range that the cluster's own CUDA build satisfies (and 2.13 CPU here). 2.6: megatron-core
        # 0.16.1's own floor (the attention's SDPA `enable_gqa` needs 2.5).
        "torch>=2.6,<3",
        "megatron-core>=0.16.1,<0.20",
        # 0.19.3: the first release with PR #8080 (ZeRO-1/2 overlap_comm gradient-bucket races under
        # compiled layers, #8061) and the fixes of #7188 (training/validation.py refuses older ones).
        "deepspeed>=0.19.3,<0.20",
        "numpy>=1.24",
        "pyyaml>=6",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "zstandard>=0.22",
        "orjson>=3.9",  # preprocessing: JSON lines parsed ~3x faster (json is the fallback)
        "tensorboard>=2.14",
        "tqdm>=4.60",  # progress bars of evaluation, token counting, conversion
    ],
    extras_require={
        # protobuf: SentencePiece -> tokenizer.json; tiktoken (0.7: o200k_base): tools/tiktoken_to_hf.py
        "hf": ["transformers>=5.0", "safetensors>=0.4", "protobuf>=3.20", "tiktoken>=0.7"],
        "eval": ["transformers>=5.0", "protobuf>=3.20", "safetensors>=0.4", "lm-eval>=0.4.5", "accelerate>=0.26", "matplotlib>=3.7",
                 "scipy>=1.10"],
        "plots": ["matplotlib>=3.7", "scipy>=1.10"],  # scipy: the experiments' paired t-tests
        "wandb": ["wandb"],
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest>=8", "transformers>=5.0", "safetensors>=0.4", "protobuf>=3.20", "tiktoken>=0.7",
                 "matplotlib>=3.7", "lm-eval>=0.4.5",
                 "scipy>=1.10", "accelerate>=0.26",  # lm-eval's HF model class imports accelerate
                 "triton>=3.2",  # LEV's CUDA kernels, tested on CPU under TRITON_INTERPRET=1
                 "mpi4py>=3.1"],  # the mpirun launch is trained in a test (Open MPI: tools/run_tests.sh)
    },
    entry_points={"console_scripts": [
        "megatron-lev-train=megatron_lev.cli:train",
        "megatron-lev-preprocess=megatron_lev.cli:preprocess",
        "megatron-lev-convert-to-hf=megatron_lev.cli:convert_to_hf",
        "megatron-lev-convert-from-hf=megatron_lev.cli:convert_from_hf",
        "megatron-lev-convert-from-mcore=megatron_lev.cli:convert_from_mcore",
        "megatron-lev-evaluate=megatron_lev.cli:evaluate",
    ]},
)
