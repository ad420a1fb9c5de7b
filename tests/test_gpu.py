"""What only a GPU can show, skipped without one: the GPU configs' preflight, and a crash and resume
that ends bit-identical to an uninterrupted run on one GPU, plain and under FSDP2, in fp32 and bf16.

    python -m pytest -n 5 --dist load tests/test_gpu.py     # on a machine with a CUDA GPU (docs/gpu.md)

On a CPU the same behaviours are asserted by test_fsdp2.py and test_checkpointing.py."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, REPO, launch, output_of
from test_checkpointing import identical, kill_launch
from test_lm import TINY, text  # noqa: F401 (the module's text fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def fsdp2_1gpu(tmp_path_factory):
    """accelerate_configs/fsdp2_4gpu.yaml with one process: FSDP2 as accelerate runs it on GPUs."""
    with open(os.path.join(CONFIGS, "fsdp2_4gpu.yaml")) as f:
        four = f.read()
    assert "num_processes: 4 " in four
    path = tmp_path_factory.mktemp("configs") / "fsdp2_1gpu.yaml"
    path.write_text(four.replace("num_processes: 4 ", "num_processes: 1 "))
    return str(path)[: -len(".yaml")]  # launch() adds .yaml to a config's name; an absolute path passes through


def test_gpu_configs_pass_or_refuse_preflight():
    from train.check_config import problems

    gpus = torch.cuda.device_count()
    assert problems(os.path.join(CONFIGS, "1gpu.yaml")) == []
    for name, wanted in (("4gpu", 4), ("8gpu", 8), ("fsdp2_4gpu", 4), ("2node_8gpu", 8), ("2node_8gpu_c10d", 8)):
        found = problems(os.path.join(CONFIGS, name + ".yaml"), machine_rank=0)
        refusal = f"{wanted} processes per machine but only {gpus} GPU(s) here"
        assert any(refusal in line for line in found) == (gpus < wanted), (name, found)


LM = [*TINY[2:], "--max_train_steps", 12, "--checkpointing_steps", 4, "--eval_steps", 6]
MNIST = [
    "--dataset",
    "fashion_mnist",
    "--max_train_samples",
    2048,
    "--max_eval_samples",
    512,
    "--per_device_train_batch_size",
    64,
    "--num_train_epochs",
    1,
    "--checkpointing_steps",
    8,
]


@pytest.fixture(scope="module")
def shards(request):
    """The demo's token shards where `make train-lm` wrote them (a GPU machine may lack `datasets`,
    which the text fixture's preparation reads .txt files with), else the tiny text's."""
    demo = os.path.join(REPO, "runs", "tokens", "gcide-bpe8192-b256")
    return demo if os.path.isfile(os.path.join(demo, "manifest.json")) else request.getfixturevalue("text")[1]


@pytest.mark.parametrize(
    "script,config,precision",
    [
        ("lm", "fsdp2", "no"),
        ("lm", "fsdp2", "bf16"),
        ("mnist", "fsdp2", "no"),
        ("mnist", "1gpu", "bf16"),
        ("lm", "1gpu", "no"),
    ],
)
def test_sigkill_then_resume_is_bit_identical_with_full_determinism(
    script, config, precision, shards, fsdp2_1gpu, fashion_dir, tmp_path
):
    config = fsdp2_1gpu if config == "fsdp2" else config
    args = [*(LM if script == "lm" else MNIST), "--mixed_precision", precision, "--full_determinism"]
    if script == "lm":
        args = ["--dataset_dir", shards, *args]
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    proc = launch(config, script, *args, "--output_dir", whole)
    assert proc.returncode == 0, output_of(proc)
    assert "device=cuda" in proc.stdout and f"mixed_precision={precision}" in proc.stdout, proc.stdout
    assert "full_determinism: deterministic kernels only" in proc.stdout
    if config == fsdp2_1gpu:
        assert "distributed_type=FSDP " in proc.stdout, proc.stdout
    kill = ["--rank", 0, "--step", 10, "--marker", tmp_path / "killed"]
    proc = kill_launch(config, script, kill, *args, "--output_dir", crashed)
    assert proc.returncode != 0 and (tmp_path / "killed").exists(), output_of(proc)
    proc = launch(config, script, *args, "--output_dir", crashed, "--resume_from_checkpoint", "latest")
    assert proc.returncode == 0, output_of(proc)
    assert "(step 8, saved with 1 process)" in proc.stdout, proc.stdout
    final = load_file(crashed / "model.safetensors")
    assert identical(final, load_file(whole / "model.safetensors"))

    # the final weights are a plain model's, on the CPU, whatever layout trained them
    results = json.load(open(whole / "all_results.json"))
    if script == "lm":
        from train.models.gpt import GPT, GPTConfig
        from train.models.gpt_hf import from_gpt2

        GPT(GPTConfig(**results["model_config"])).load_state_dict(from_gpt2(final))  # a GPT-2 folder's weights
    else:
        from train.mnist import MODELS, ConvNet

        ConvNet(**MODELS[json.load(open(whole / "args.json"))["model"]]).load_state_dict(final)
