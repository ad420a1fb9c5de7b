"""train/mnist.py on real Fashion-MNIST: 2 real processes through accelerate launch (map-style and
--streaming, both in bf16 asked of the launcher, with the recipe's flags), and in-process."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from cases_probe import case_output, launch_cases, run_case
from conftest import output_of, run_as_script
from data.errors import UserError
from train import mnist

EVAL_SAMPLES = 1001  # odd: with 2 processes and eval batch 500 the last batch is padded, padding must not count


# the recipe's augmentation, smoothing and warmup, and bf16 asked of the launcher (not the script), in
# both launched runs; 20 steps, as bf16 is emulated on this CPU (ONEDNN_MAX_CPU_ISA=AVX2): 1280 samples
# cost 18 CPU-s a launch, 3000 cost 23
SMALL_RUN = [
    "--dataset",
    "fashion_mnist",
    "--max_train_samples",
    1280,
    "--max_eval_samples",
    EVAL_SAMPLES,
    "--num_train_epochs",
    1,
    "--per_device_train_batch_size",
    32,
    "--augment",
    "--label_smoothing",
    0.1,
    "--num_warmup_steps",
    5,
]
STEPS = 1280 // 64  # drop_last: whole global batches of 2 x 32


@pytest.fixture(scope="module")
def launched(fashion_dir, tmp_path_factory):
    """Both launched runs in one launch (tests/cases_probe.py), bf16 asked of the launcher: map-style,
    then --streaming with its parquet shards prepared in the run. The launch and the folder."""
    root = tmp_path_factory.mktemp("mnist")
    cases = [
        run_case("map_style", "mnist", root / "map", *SMALL_RUN),
        run_case("streaming", "mnist", root / "out", *SMALL_RUN, "--streaming", "--parquet_dir", root / "parquet"),
    ]
    return launch_cases("cpu_2proc", cases, launch_args=["--mixed_precision", "bf16"]), root


@pytest.fixture(scope="module")
def map_style_run(launched):
    proc, root = launched
    mine = {stream: case_output(getattr(proc, stream), "map_style") for stream in ("stdout", "stderr")}
    return SimpleNamespace(returncode=proc.returncode, **mine), root / "map"


def test_two_processes_train_and_count_eval_exactly(fashion_dir, map_style_run):
    proc, tmp_path = map_style_run
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert "process 0/2 " in proc.stdout and "process 1/2 " in proc.stdout, out
    assert "world_size=2 " in proc.stdout and "distributed_type=MULTI_CPU" in proc.stdout, out
    assert "mixed_precision=bf16 (from accelerate launch --mixed_precision)" in proc.stdout, out
    assert f"source={fashion_dir}" in proc.stdout  # it says which data it used

    results = json.load(open(tmp_path / "all_results.json"))
    assert results["world_size"] == 2
    assert results["eval_samples"] == EVAL_SAMPLES
    # chance is 0.1; 20 steps of augmented bf16 training measured 0.65 (46 fp32 steps, 0.77, were held to 0.6)
    assert results["eval_accuracy"] > 0.5
    assert results["step"] == STEPS
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["classifier.weight"].shape == (10, 7 * 7 * 32)
    assert json.load(open(tmp_path / "args.json"))["max_eval_samples"] == EVAL_SAMPLES


def test_streaming_path_under_two_processes_matches_map_style(launched, map_style_run):
    proc, tmp_path = launched
    output = case_output(proc.stdout, "streaming")
    assert proc.returncode == 0, output_of(proc)
    assert "world_size=2 " in output and "sharded iterable" in output and "mixed_precision=bf16" in output
    # the prepare step wrote 8 train + 8 test shards + manifest, and left its (released) lock file
    assert sorted(set(os.listdir(tmp_path / "parquet")) - {".lock"}) == sorted(
        [f"{split}-{i:05d}-of-00008.parquet" for split in ("test", "train") for i in range(8)] + ["manifest.json"]
    )
    streaming = json.load(open(tmp_path / "out" / "all_results.json"))
    map_style = json.load(open(map_style_run[1] / "all_results.json"))
    assert streaming["eval_samples"] == EVAL_SAMPLES  # padding excluded through the valid mask
    assert streaming["step"] == map_style["step"] == STEPS
    assert streaming["eval_accuracy"] > 0.5
    assert abs(streaming["eval_accuracy"] - map_style["eval_accuracy"]) < 0.05


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("layout", ["raw_torchvision_layout", "gz_flat"])
def test_in_process_smoke_from_data_dir(tmp_path, fashion_dir, layout):
    data_dir = tmp_path / "data"
    if layout == "gz_flat":
        data_dir.mkdir()
        for name in os.listdir(fashion_dir):
            os.symlink(os.path.join(fashion_dir, name), data_dir / name)
    else:  # torchvision's download layout, uncompressed
        import gzip

        raw = data_dir / "FashionMNIST" / "raw"
        raw.mkdir(parents=True)
        for name in os.listdir(fashion_dir):
            (raw / name[:-3]).write_bytes(gzip.open(os.path.join(fashion_dir, name)).read())
    args = mnist.parse_args(
        [
            "--data_dir",
            str(data_dir),
            "--max_train_samples",
            "640",
            "--max_eval_samples",
            "333",
            "--max_train_steps",
            "5",
            "--per_device_train_batch_size",
            "64",
            "--gradient_accumulation_steps",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    results = mnist.main(args)
    assert results["eval_samples"] == 333 and results["step"] == 5 and results["world_size"] == 1
    assert results["data_source"].startswith(str(data_dir))
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_on_disk_only_when_nothing_is_left_to_download(tmp_path, fashion_dir):
    """mnist_on_disk decides whether every process reads the idx files at once: only when all four are
    there already (a --data_dir in either layout, the system copy, the download cache)."""
    from data import mnist_on_disk

    assert mnist_on_disk("fashion_mnist", fashion_dir)
    assert mnist_on_disk("fashion_mnist", None, download_root=str(tmp_path))  # the system copy
    assert not mnist_on_disk("mnist", None, download_root=str(tmp_path))  # no system copy: one process downloads
    partial = tmp_path / "partial"
    partial.mkdir()
    names = sorted(os.listdir(fashion_dir))
    for name in names[:3]:
        os.symlink(os.path.join(fashion_dir, name), partial / name)
    assert not mnist_on_disk("fashion_mnist", str(partial))  # a file missing: one process reports it
    os.symlink(os.path.join(fashion_dir, names[3]), partial / names[3])
    assert mnist_on_disk("fashion_mnist", str(partial))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_gradient_accumulation_is_one_step_per_n_batches(tmp_path, fashion_dir):
    args = mnist.parse_args(
        [
            "--max_train_samples",
            "640",
            "--max_eval_samples",
            "10",
            "--num_train_epochs",
            "1",
            "--per_device_train_batch_size",
            "32",
            "--gradient_accumulation_steps",
            "4",
            "--output_dir",
            str(tmp_path),
        ]
    )
    results = mnist.main(args)
    assert results["step"] == 640 // 32 // 4
    assert results["global_batch_size"] == 128


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_nothing_of_accelerate_is_replaced():
    """Private patches of accelerate break on its next release: make_accelerator and a training step
    leave every attribute of accelerate's modules as accelerate defined it."""
    import accelerate
    import accelerate.accelerator
    import accelerate.optimizer
    import accelerate.state

    from train.core.accelerator import make_accelerator

    modules = (accelerate, accelerate.accelerator, accelerate.optimizer, accelerate.state)
    classes = (accelerate.Accelerator, accelerate.optimizer.AcceleratedOptimizer)
    before = [dict(vars(m)) for m in modules + classes]
    accelerator = make_accelerator(mnist.parse_args(["--cpu", "--gradient_accumulation_steps", "2"]))
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
            optimizer.zero_grad()
    after = [dict(vars(m)) for m in modules + classes]
    for owner, old, new in zip(modules + classes, before, after, strict=True):
        changed = [name for name in old if name in new and new[name] is not old[name]]
        assert changed == [], f"{owner.__name__}: {changed}"
    # and no earlier test in this process replaced them either
    for owner in classes:
        assert all(
            getattr(value, "__module__", owner.__module__).startswith("accelerate")
            for value in vars(owner).values()
            if callable(value)
        ), owner
    assert accelerate.optimizer.is_lomo_available.__module__.startswith("accelerate")


def test_loaded_tensors_are_uint8_in_memory(fashion_dir):
    from data import load_mnist, normalize_images

    train, test, source = load_mnist("fashion_mnist")
    assert (len(train), len(test)) == (60000, 10000) and fashion_dir in source
    assert train.images.dtype == torch.uint8 and train.images.shape == (60000, 28, 28)
    batch = train.__getitems__([3, 1, 4])
    assert (
        torch.equal(batch["image"][1], train.images[1]) and batch["label"].tolist() == train.labels[[3, 1, 4]].tolist()
    )
    x = normalize_images(train.images[:2000], train.mean, train.std)
    assert x.shape == (2000, 1, 28, 28)
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05  # the stored mean/std fit the data


def test_an_fsdp1_config_on_cpu_processes_is_one_line(tmp_path, capsys, monkeypatch):
    """FSDP2 configs shard on CPU processes too (tests/test_fsdp2.py); accelerate's FSDP1 needs a GPU
    (its plugin raised 'no available devices' in the constructor). What accelerate launch exports
    for an FSDP1 config, then the script as launched."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    proc = run_as_script(capsys, "regression", "--max_train_steps", 3, "--output_dir", tmp_path / "out")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, output_of(proc)
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: the accelerate config asks for FSDP version 1, which runs on GPUs only; for CPU processes set "
            "fsdp_version: 2"
        )
    ), output_of(proc)


@pytest.mark.parametrize("model", sorted(m for m, kw in mnist.MODELS.items() if not kw.get("norm_after_pool")))
def test_pool_before_relu_is_bitwise_the_seed_model(model):
    """ConvNet pools before its ReLUs (faster); outputs and gradients must equal the seed's order."""
    torch.manual_seed(0)
    ours = mnist.ConvNet(**mnist.MODELS[model])
    seed_order = torch.nn.Sequential(*[ours.features[i] for i in (0, 1, 3, 2, 4, 5, 7, 6)])
    x = torch.randn(64, 1, 28, 28)
    x[:8] = -x[:8].abs()  # windows that are all negative: ties at zero after the ReLU
    out_ours = ours(x)
    grads_ours = torch.autograd.grad(out_ours.square().sum(), list(ours.parameters()))
    out_seed = ours.classifier(seed_order(x).flatten(1))
    grads_seed = torch.autograd.grad(out_seed.square().sum(), list(ours.parameters()))
    assert torch.equal(out_ours, out_seed)
    assert all(torch.equal(a, b) for a, b in zip(grads_ours, grads_seed, strict=True))


def test_augment_images_shifts_and_flips_each_image_reproducibly():
    from data import augment_images

    images = torch.randint(1, 256, (1000, 28, 28), dtype=torch.uint8)  # no zeros: the fill is recognisable
    out = augment_images(images, 5)
    assert out.shape == (1000, 28, 28) and out.dtype == torch.uint8
    assert torch.equal(out, augment_images(images.reshape(1000, 784), 5))
    assert not torch.equal(out, augment_images(images, 6))
    seen = set()
    for image, result in zip(images, out, strict=True):
        padded = [torch.nn.functional.pad(src, (2, 2, 2, 2)) for src in (image, image.flip(-1))]
        matches = [
            (flip, dy, dx)
            for flip in (0, 1)
            for dy in range(-2, 3)
            for dx in range(-2, 3)
            if torch.equal(padded[flip][2 + dy : 30 + dy, 2 + dx : 30 + dx], result)
        ]
        assert len(matches) == 1  # exactly one shift/flip explains each output
        seen.add(matches[0])
    assert len(seen) == 50  # every one of the 2 x 5 x 5 variants occurs (each missed with p < 1e-8)


def test_resume_with_another_model_is_refused(fashion_dir, tmp_path):
    args = [
        "--max_train_samples",
        "640",
        "--max_eval_samples",
        "100",
        "--num_train_epochs",
        "1",
        "--per_device_train_batch_size",
        "32",
        "--checkpointing_steps",
        "10",
        "--output_dir",
        str(tmp_path),
    ]
    mnist.main(mnist.parse_args(args))
    os.remove(tmp_path / "all_results.json")  # unfinished, as a crash leaves it: a finished run is not resumed
    with pytest.raises(UserError, match="does not fit this model"):
        mnist.main(mnist.parse_args(args + ["--model", "convnet_wide", "--resume_from_checkpoint", "latest"]))
