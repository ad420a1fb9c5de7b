"""train/image_classification.py on real images: Fashion-MNIST written as PNG class folders (a small
slice), trained with 2 real CPU processes; every validation image counted once; bit-identical resume
after a real SIGKILL on both data paths; prediction with the trained run; images of every format and mode;
torchvision models by name and local pretrained weights; and each kind of bad folder as one line."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from cases_probe import case_output, check_crash_case, crash_case, launch_cases
from conftest import launch, output_of, reset_accelerate_state, run_as_script, run_script
from data.image_pixels import image_transforms, keep_budget
from data.images import TENSOR_OVERHEAD, ImageFileSource, ImageFolderDataset, load_image, scan_image_folder
from data.mnist import CLASS_NAMES, write_image_folders
from data.sharding import ShardedIterableDataset
from test_checkpointing import weights
from train import image_classification

CLASSES = sorted(CLASS_NAMES["fashion_mnist"])
SMALL = ["--image_size", 32, "--per_device_train_batch_size", 16, "--logging_steps", 5, "--dataloader_num_workers", 1]


@pytest.fixture(scope="module")
def folders(fashion_dir, tmp_path_factory):
    """60 training and 30 validation PNGs per class; one validation image removed, so 299 of them:
    an odd count that fills no batch of any size the tests use."""
    root = str(tmp_path_factory.mktemp("images") / "fashion_mnist")
    write_image_folders("fashion_mnist", root, max_per_class=60)
    for name in CLASSES:  # validation: keep 30 per class
        files = sorted(os.listdir(os.path.join(root, "validation", name)))
        for f in files[30:]:
            os.remove(os.path.join(root, "validation", name, f))
    os.remove(os.path.join(root, "validation", "Bag", sorted(os.listdir(os.path.join(root, "validation", "Bag")))[0]))
    return os.path.join(root, "train"), os.path.join(root, "validation")


@pytest.fixture(scope="module")
def crashes(folders, tmp_path_factory):
    """Both data paths' runs of the tests below in one launch (tests/cases_probe.py), each with rank 0
    SIGKILLed as a checkpoint mid epoch 2 is published, then resumed by torch elastic's restart, which
    must save the same checkpoint (crash_during_save_and_resume's checks, as cases): map-style with a
    DataLoader worker per rank, 3 epochs of 18 steps, killed at 28 (resumed from 24); streaming without
    workers, 2 x 10 steps, killed at 16 (resumed from 12). The launch and each case's resumed folder."""
    train_dir, validation_dir = folders
    root = tmp_path_factory.mktemp("crashes")
    common = ["--train_dir", train_dir, "--validation_dir", validation_dir, *SMALL, "--checkpointing_steps", 4]
    streaming = ["--max_train_samples", 320, "--num_train_epochs", 2, "--streaming", "--dataloader_num_workers", 0]
    steps = {"map_style": 28, "streaming": 16}
    for name in steps:
        (root / name).mkdir()
    cases = [
        crash_case("map_style", "image_classification", 28, root / "map_style", *common, "--num_train_epochs", 3),
        crash_case("streaming", "image_classification", 16, root / "streaming", *common, *streaming),
    ]
    proc = launch_cases("cpu_2proc", cases, max_restarts=2)
    return proc, {name: check_crash_case(proc, root / name, step) for name, step in steps.items()}


@pytest.fixture(scope="module")
def trained(crashes):
    """The map-style run: its part of the launch's output (both of its attempts) and its folder."""
    proc, folders = crashes
    return case_output(proc.stdout, "map_style"), folders["map_style"]


def test_two_processes_learn_well_above_chance_and_count_every_image_once(trained):
    output, out = trained
    assert "world_size=2 " in output
    # once per attempt (the crashed one and its restart): the main process's line only
    assert output.count("train: 600 images in 10 classes; validation: 299 images in 10 classes") == 2
    # 600 x 28^2 + 299 x 32^2 RGB; the pixels kept without workers: the streaming run's
    assert output.count("images: 4 MB decoded, decoded again each time (DataLoader workers)") == 2
    results = json.load(open(out / "all_results.json"))
    assert results["eval_samples"] == 299 and results["world_size"] == 2 and results["train_samples"] == 600
    assert [h["eval_samples"] for h in results["history"]] == [299] * 3  # the epochs before the crash kept
    assert results["eval_accuracy"] > 0.5, results  # chance is 0.1
    assert json.load(open(out / "labels.json")) == CLASSES == results["classes"]
    assert (out / "curves.png").stat().st_size > 0 and (out / "metrics.jsonl").stat().st_size > 0


def test_predict_agrees_with_the_evaluation(trained, folders, capsys):
    _, out = trained
    proc = run_as_script(capsys, "image_classification", "--predict", folders[1], "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    lines = [line.split("\t") for line in proc.stdout.splitlines()]
    assert len(lines) == 299 and all(c in CLASSES and 0 < float(p) <= 1 for _, c, p in lines)
    correct = sum(os.path.basename(os.path.dirname(path)) == c for path, c, _ in lines)
    best = json.load(open(out / "all_results.json"))["best_model"]["metrics"]  # model.safetensors is the best's
    assert abs(correct - best["eval_accuracy"] * 299) <= 1
    one = run_as_script(capsys, "image_classification", "--predict", lines[0][0], "--output_dir", out)
    assert one.returncode == 0 and one.stdout.count("\n") == 1


@pytest.mark.parametrize("path", ["map_style", "streaming"])
def test_resume_after_a_crash_is_bit_identical_under_two_processes(crashes, path):
    # a SIGKILL as a checkpoint mid epoch 2 is published: the restart resumes from the one before and must
    # save the same (crash_during_save_and_resume's checks compare every rank's RNG streams too: torch's
    # global generator, which a mid-epoch iterator of a resumed run would draw its workers' base seed from
    # without the loader's own generator); map-style with a DataLoader worker per rank at the SIGKILL
    # (28, resumed from 24), streaming without (16 of 2 x 10 steps, from 12)
    proc, folders = crashes
    crashed, resumed = folders[path], {"map_style": 24, "streaming": 12}[path]
    output = case_output(proc.stdout, path)
    assert f"resumed from {crashed}/checkpoints/step_{resumed:08d}" in output
    assert (crashed / "model.safetensors").exists()
    if path == "streaming":  # without workers each process keeps the pixels it decodes (320 x 28^2 + 299 x 32^2 RGB)
        assert output.count("images: 3 MB decoded, kept by each process as it decodes them") == 2


def test_streaming_source_reads_each_image_once_per_epoch_split_across_ranks(folders):
    images = scan_image_folder(folders[1], "--validation_dir", CLASSES).subset(100, 0)
    seen, reads = [], []
    for rank in range(2):
        source = ImageFileSource(ImageFolderDataset(images, 32, train=True, seed=1))
        dataset = ShardedIterableDataset(source, 20, rank=rank, world_size=2, seed=1, policy="drop")
        seen += [i for batch in dataset for i in batch["index"].tolist()]
        reads.append(source.rows_read)
    assert sorted(seen) == list(range(100)) and reads == [50, 50]  # each rank decoded its half only


def test_every_format_and_mode_and_size_becomes_one_rgb_square(tmp_path):
    made = {
        "a/rgb.png": ("RGB", (40, 30)),
        "a/gray.jpg": ("L", (17, 50)),
        "a/nested/palette.bmp": ("P", (28, 28)),
        "b/rgba.webp": ("RGBA", (64, 20)),
        "b/palette_alpha.png": ("P", (9, 33)),
        "b/16bit.png": ("I;16", (30, 30)),
    }
    for name, (mode, size) in made.items():
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        image = Image.new(mode, size, 7)
        if name.endswith("palette_alpha.png"):
            image.info["transparency"] = 0
        image.save(tmp_path / name, **({"transparency": 0} if "alpha" in name else {}))
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    images = scan_image_folder(str(tmp_path), "--train_dir")
    assert images.classes == ["a", "b"] and len(images) == 6 and images.labels == [0, 0, 0, 1, 1, 1]
    assert "ignored 1 file(s) without an image extension" in images.summary()
    assert "skipped 1 unreadable file(s) (first: " in images.summary() and "broken.png" in images.summary()
    for train in (True, False):
        dataset = ImageFolderDataset(images, 24, train=train, cache=train)
        for i in range(len(dataset)):
            sample = dataset[i]
            assert sample["image"].shape == (3, 24, 24) and sample["image"].dtype == torch.uint8


def test_kept_pixels_crop_and_flip_as_torchvision_does_from_the_file(tmp_path):
    # sizes that take torchvision's fallback crop (5x90, 90x5) as well as the sampled one
    rng = np.random.default_rng(0)
    sizes = [(28, 28), (40, 30), (17, 50), (64, 20), (9, 33), (200, 150), (5, 90), (90, 5)]
    for n in range(48):
        w, h = sizes[n % len(sizes)]
        os.makedirs(tmp_path / "ab"[n % 2], exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / "ab"[n % 2] / f"{n}.png")
    images = scan_image_folder(str(tmp_path), "--train_dir")
    assert images.decoded_bytes() == sum(3 * w * h + TENSOR_OVERHEAD for w, h in sizes) * 6
    reference = image_transforms(24, True)  # torchvision's transforms under the global generator
    for cache in (False, True):
        dataset = ImageFolderDataset(images, 24, train=True, seed=5, cache=cache)
        for epoch in range(3):  # with the cache: decoded in epoch 0, cropped from memory after
            dataset.set_epoch(epoch)
            for i in range(len(images)):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(hash((5, epoch, i)) & (2**63 - 1))
                    expected = reference(load_image(images.files[i]))
                assert torch.equal(dataset[i]["image"], expected), (cache, epoch, i)
        assert len(dataset.cache or {}) == (len(images) if cache else 0)
    evaluation = ImageFolderDataset(images, 24, cache=True)
    for i in list(range(len(images))) * 2:
        assert torch.equal(evaluation[i]["image"], image_transforms(24, False)(load_image(images.files[i])))
    evaluation[0]["image"].zero_()  # a sample is the caller's to change: the kept square stays as it was
    assert torch.equal(evaluation[0]["image"], image_transforms(24, False)(load_image(images.files[0])))


def test_pixels_are_kept_only_without_workers_and_within_the_memory_budget():
    assert keep_budget(processes=2, num_workers=4, free=8 * 2**30) == 0
    assert keep_budget(1, 0, free=8 * 2**30) == 2 * 2**30 and keep_budget(2, 0, free=8 * 2**30) == 2**30
    assert keep_budget(1, 0) > 0  # this machine's free memory, read


def test_augmentation_depends_on_seed_epoch_and_sample_only(folders):
    images = scan_image_folder(folders[1], "--validation_dir", CLASSES).subset(4, 0)
    dataset = ImageFolderDataset(images, 32, train=True, seed=3)
    first = [dataset[i]["image"] for i in range(4)]
    torch.manual_seed(123)  # the global generator has no say
    assert all(torch.equal(dataset[i]["image"], first[i]) for i in range(4))
    dataset.set_epoch(1)
    assert not all(torch.equal(dataset[i]["image"], first[i]) for i in range(4))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_torchvision_model_by_name_with_local_pretrained_weights(folders, tmp_path):
    import torchvision
    from safetensors.torch import save_file

    pretrained = torchvision.models.resnet18(num_classes=1000).state_dict()  # as a downloaded weights file would be
    torch.save(pretrained, tmp_path / "resnet18.pth")
    save_file({k: v.contiguous() for k, v in pretrained.items()}, str(tmp_path / "resnet18.safetensors"))
    for name in ("resnet18.pth", "resnet18.safetensors"):
        out = tmp_path / name.replace(".", "_")
        results = image_classification.main(
            image_classification.parse_args(
                [
                    "--train_dir",
                    folders[0],
                    "--validation_dir",
                    folders[1],
                    "--model",
                    "resnet18",
                    "--image_size",
                    "32",
                    "--max_train_steps",
                    "2",
                    "--max_eval_samples",
                    "20",
                    "--dataloader_num_workers",
                    "0",
                    "--pretrained_weights",
                    str(tmp_path / name),
                    "--output_dir",
                    str(out),
                ]
            )
        )
        reset_accelerate_state()
        saved = weights(out)
        assert results["eval_samples"] == 20 and saved["fc.weight"].shape == (10, 512)
        assert not torch.equal(saved["conv1.weight"], torchvision.models.resnet18(num_classes=10).conv1.weight)


# ----------------------------------------------------------------------------- bad input: one line, exit 1


def _class_folders(root, counts):
    for name, n in counts.items():
        os.makedirs(root / name, exist_ok=True)
        for i in range(n):
            Image.new("L", (8, 8), i).save(root / name / f"{i}.png")
    return str(root)


def _fails_with(proc, text):
    output = output_of(proc)
    assert proc.returncode == 1, output
    assert text in output, output
    assert "Traceback" not in output and output.count("error: ") == 1, output


def test_bad_folders_each_fail_in_one_line(tmp_path, capsys):
    good = _class_folders(tmp_path / "good", {"cat": 4, "dog": 4})
    (tmp_path / "empty").mkdir()
    loose = tmp_path / "loose"
    loose.mkdir()
    Image.new("L", (8, 8)).save(loose / "x.png")
    cases = {
        str(tmp_path / "missing"): "is not a folder",
        str(tmp_path / "empty"): "has no class subfolders (it is empty)",
        str(loose): "has no class subfolders (its images sit directly in it)",
        _class_folders(tmp_path / "one", {"cat": 3}): "has one class folder (cat); a classifier needs at least two",
        _class_folders(tmp_path / "hollow", {"cat": 3, "dog": 0}): "hollow/dog holds no readable images",
    }

    def fails(*args):
        return run_as_script(capsys, "image_classification", *args, "--output_dir", tmp_path / "out")

    for train_dir, text in cases.items():
        _fails_with(fails("--train_dir", train_dir), text)
    unknown = _class_folders(tmp_path / "val", {"cat": 2, "bird": 2})
    _fails_with(
        fails("--train_dir", good, "--validation_dir", unknown),
        "has class folder(s) the training set does not have: bird",
    )
    _fails_with(fails("--train_dir", good, "--model", "resnet_18"), "(did you mean resnet18")
    _fails_with(
        run_as_script(capsys, "image_classification", "--predict", good, "--output_dir", tmp_path / "nothing"),
        "holds no finished image classification run",
    )


def test_image_that_fails_to_decode_in_a_worker_is_one_line(tmp_path):
    root = _class_folders(tmp_path / "imgs", {"cat": 4, "dog": 4})
    Image.new("RGB", (200, 200), 3).save(os.path.join(root, "dog", "big.png"))
    data = open(os.path.join(root, "dog", "big.png"), "rb").read()
    open(os.path.join(root, "dog", "big.png"), "wb").write(data[: len(data) // 2])  # header fine, pixels cut off
    proc = run_script(
        "image_classification",
        "--train_dir",
        root,
        "--validation_dir",
        root,
        "--output_dir",
        tmp_path / "out",
        "--per_device_train_batch_size",
        2,
        "--image_size",
        16,
        "--dataloader_num_workers",
        1,
    )  # raised in a worker, printed by the training process
    _fails_with(proc, "big.png cannot be decoded")


def test_bad_folder_under_two_processes_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()  # beside the output folder, which the run creates before it scans
    proc = launch(
        "cpu_2proc",
        "image_classification",
        "--train_dir",
        tmp_path / "empty",
        "--output_dir",
        tmp_path / "out",
        timeout=120,
    )
    output = output_of(proc)
    assert proc.returncode != 0 and output.count("has no class subfolders (it is empty)") == 1, output


def test_predict_goes_on_past_an_undecodable_file(trained, folders, tmp_path, capsys):
    _, out = trained
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in sorted(os.listdir(os.path.join(folders[1], "Bag")))[:2]:
        shutil.copy(os.path.join(folders[1], "Bag", name), mixed / name)
    Image.new("RGB", (300, 300), 5).save(mixed / "cut.png")
    data = (mixed / "cut.png").read_bytes()
    (mixed / "cut.png").write_bytes(data[: len(data) // 2])
    proc = run_as_script(capsys, "image_classification", "--predict", mixed, "--output_dir", out)
    assert proc.returncode == 0, output_of(proc)
    assert len(proc.stdout.splitlines()) == 2 and "cut.png" not in proc.stdout
    assert proc.stderr.count("warning: skipped ") == 1 and "cut.png cannot be decoded" in proc.stderr


def test_held_out_split_says_so_and_counts_skipped_files_once(tmp_path):
    root = tmp_path / "imgs"
    _class_folders(root, {"cat": 10, "dog": 10})
    (root / "cat" / "broken.png").write_bytes(b"not a png")
    train, held_out = scan_image_folder(str(root), "--train_dir").split(0.2, seed=0)
    assert len(train) == 16 and len(held_out) == 4 and sorted(held_out.labels) == [0, 0, 1, 1]
    assert "skipped 1 unreadable" in train.summary() and "skipped" not in held_out.summary()
    assert "held out from --train_dir: 20% of each class" in held_out.summary()
    assert not set(train.files) & set(held_out.files)


def test_whole_pickled_model_as_pretrained_weights_is_one_line(tmp_path, capsys):
    good = _class_folders(tmp_path / "good", {"cat": 4, "dog": 4})
    torch.save(torch.nn.Linear(2, 2), tmp_path / "model.pth")  # the object, not its state_dict
    (tmp_path / "notes.pth").write_text("hello")
    for name, text in (("model.pth", "save model.state_dict() instead"), ("notes.pth", "is not a .safetensors")):
        _fails_with(
            run_as_script(
                capsys,
                "image_classification",
                "--train_dir",
                good,
                "--pretrained_weights",
                tmp_path / name,
                "--output_dir",
                tmp_path / "out",
                "--image_size",
                16,
            ),
            text,
        )


# ----------------------------------------------------------------------------- defaults that follow the data


def test_image_size_and_epochs_follow_the_data(tmp_path):
    pick_size, pick_epochs = image_classification.pick_image_size, image_classification.pick_num_train_epochs
    digits = scan_image_folder(_class_folders(tmp_path / "digits", {"0": 3, "1": 3}), "--train_dir")
    assert digits.median_size == (8, 8) and pick_size("convnet", digits.median_size)[0] == 32
    photos = tmp_path / "photos"  # short sides 8, 200, 200, 480, 480 (stable order): the median is a/1.png
    for name, size in {
        "a/0.jpg": (300, 200),
        "a/1.png": (200, 300),
        "a/2.png": (8, 8),
        "b/0.png": (640, 480),
        "b/1.png": (480, 640),
    }.items():
        os.makedirs(photos / os.path.dirname(name), exist_ok=True)
        Image.new("RGB", size).save(photos / name)
    scanned = scan_image_folder(str(photos), "--train_dir")
    assert min(scanned.median_size) == 200 and pick_size("convnet", scanned.median_size) == (
        64,
        "the median image is 200x300; convnet takes 32 to 64",
    )
    assert scanned.split(0.4, seed=0)[0].median_size == scanned.median_size  # the whole training folder's
    assert [pick_size("convnet", s)[0] for s in ((28, 28), (40, 52), (64, 56), (4000, 3000))] == [32, 40, 56, 64]
    assert pick_size("resnet18", (8, 8))[0] == 224
    # 1,000 optimizer steps, 3 to 50 epochs: 8x8 digits (1,437 at a global batch of 64), Fashion-MNIST, a handful
    assert pick_epochs(1437, 22) == (46, "1,437 training images: 22 optimizer steps per epoch")
    assert pick_epochs(60000, 937)[0] == 3
    assert pick_epochs(8, 1) == (
        50,
        "8 training images: 1 optimizer step per epoch, 50 in 50 epochs: more images would help",
    )


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_picked_defaults_are_said_recorded_and_kept_by_a_resume(tmp_path, capsys):
    root = _class_folders(tmp_path / "digits", {"0": 1, "1": 1})  # two 8x8 images, one batch: 1 step per epoch
    common = [
        "--train_dir",
        root,
        "--validation_dir",
        root,
        "--per_device_train_batch_size",
        2,
        "--dataloader_num_workers",
        0,
        "--logging_steps",
        10,
    ]

    def train(out, *more):
        capsys.readouterr()
        image_classification.main(
            image_classification.parse_args([*map(str, common + ["--output_dir", out]), *map(str, more)])
        )
        reset_accelerate_state()
        return capsys.readouterr().out, json.load(open(out / "args.json"))

    said, args = train(tmp_path / "picked", "--checkpointing_steps", 48)
    assert (
        "image_size=32 (the median image is 8x8; convnet takes 32 to 64; pass --image_size to choose) "
        "num_train_epochs=50 (2 training images: 1 optimizer step per epoch" in said
    )
    assert "epochs=50 steps=50 " in said and args["image_size"] == 32 and args["num_train_epochs"] == 50
    checkpoint = tmp_path / "picked" / "checkpoints" / "step_00000048"
    assert json.load(open(checkpoint / "meta.json"))["args"]["num_train_epochs"] == 50
    said, args = train(tmp_path / "resumed", "--resume_from_checkpoint", checkpoint)  # picks the saved run's 50
    assert "epochs=50 steps=50 steps_per_epoch=1 resuming at step 48" in said and args["num_train_epochs"] == 50
    said, args = train(tmp_path / "chosen", "--image_size", 16, "--max_train_steps", 3)  # flags win; nothing said
    assert "pass --" not in said and (args["image_size"], args["num_train_epochs"]) == (16, 3)  # 3 steps: 3 epochs
    parse = image_classification.parse_args  # an explicit --num_train_epochs in a run: the `trained` fixture's 3
    assert parse(["--train_dir", root]).num_train_epochs is None  # main() picks it
    assert parse(["--train_dir", root, "--num_train_epochs", "2"]).num_train_epochs == 2
