"""A fine-tuning script's data as two splits, train and validation, from wherever a user has it:
local files (--train_file/--validation_file: csv, tsv, json, jsonl, parquet), a folder written by
`save_to_disk`, or a dataset name (--dataset_name/--dataset_config_name: what `datasets.load_dataset`
takes, a Hub name or a local dataset folder such as a cloned Hub dataset repository).

The validation split is --validation_file, else the dataset's own `validation` split, else its
`test` split, else a seeded --validation_split_percentage of the training rows held out. A split
is named in the run's header by `where`. For labelled data, a `test` split whose labels are all
missing (a benchmark's hidden test split: datasets writes -1 for "no label") is not used: the
validation rows are held out of train instead, and `where` says so.

`inputs_key` is what decides the splits' content, for a cache of what is made from them: the files'
bytes, a local dataset folder's files, or for a Hub dataset its name, configuration and the Arrow
files datasets made of it.
"""

import os
from collections import namedtuple

from data.errors import DataError
from data.local_files import hold_out, load_files
from data.shards import hash_files

# the flags of add_data_files_args, as one value
DataInputs = namedtuple(
    "DataInputs",
    "train_file validation_file dataset_name dataset_config_name validation_split_percentage seed",
    defaults=(None, None, None, None, None, 0),
)


def check_inputs(inputs):
    """One line for flags that cannot go together or are missing."""
    if inputs.dataset_name and (inputs.train_file or inputs.validation_file):
        raise DataError(
            "--dataset_name takes its splits from the dataset; leave out --train_file and "
            "--validation_file (or pass files alone, without --dataset_name)"
        )
    if not inputs.dataset_name and not inputs.train_file:
        raise DataError("pass --train_file (your files) or --dataset_name (a Hub dataset or a local dataset folder)")
    if inputs.dataset_config_name and not inputs.dataset_name:
        raise DataError("--dataset_config_name goes with --dataset_name; pass both, or neither")
    if inputs.dataset_name and not os.path.isdir(inputs.dataset_name) and looks_like_a_path(inputs.dataset_name):
        raise DataError(
            f"--dataset_name {inputs.dataset_name}: no such folder; pass a dataset folder (data files and "
            "a README naming its configs) or a Hub dataset name (org/name)"
        )


def looks_like_a_path(name):
    """Whether `name`, which is not a folder here, was meant as one rather than as a Hub name (org/name):
    it starts like a path, has more parts than a Hub name, or its first part is a folder here."""
    parts = os.path.normpath(name).split(os.sep)
    return name.startswith(("/", ".", "~")) or len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def _files_under(folder):
    """A folder's files, for its content hash: hidden ones left out (a cloned repository's .git, caches)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
    return files


def _content(paths):
    """Of files' contents and kinds (the same bytes as .csv and .tsv are other rows)."""
    if len(paths) == 1 and os.path.isdir(paths[0]):
        paths = _files_under(paths[0])
    return [
        {"kind": os.path.splitext(entry["path"])[1], "bytes": entry["bytes"], "blake2b": entry["blake2b"]}
        for entry in hash_files(paths)
    ]


def inputs_key(inputs):
    """What decides the content of the two splits (a JSON-able value), without loading them where the
    inputs are files or folders."""
    held_out = [inputs.validation_split_percentage or 10, inputs.seed]  # used only where there is no validation
    if not inputs.dataset_name:
        return {
            "inputs": _content(inputs.train_file),
            "validation": inputs.validation_file and _content(inputs.validation_file),
            "split": None if inputs.validation_file else held_out,
        }
    if os.path.isdir(inputs.dataset_name):
        source = _content([inputs.dataset_name])
    else:  # a Hub dataset: datasets' own Arrow files of it, named by its revision and configuration
        loaded = load_named(inputs.dataset_name, inputs.dataset_config_name)
        source = {
            split: [[f["filename"], os.path.getsize(f["filename"])] for f in ds.cache_files]
            for split, ds in loaded.items()
        }
    return {"dataset": inputs.dataset_name, "config": inputs.dataset_config_name, "inputs": source, "split": held_out}


def stem(inputs):
    """A short name for folders made from these inputs."""
    if inputs.dataset_name:
        return "--".join(p for p in os.path.normpath(inputs.dataset_name).split(os.sep)[-2:] if p not in ("", "."))
    return os.path.splitext(os.path.basename(os.path.normpath(inputs.train_file[0])))[0]


def load_named(name, config=None):
    """datasets.load_dataset(name, config) as a DatasetDict, or one line saying why not."""
    import datasets

    datasets.disable_progress_bars()
    what = f"--dataset_name {name}" + (f" --dataset_config_name {config}" if config else "")
    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as e:  # datasets raises many types, wrapped; the innermost says what was wrong
        while e.__cause__ is not None:
            e = e.__cause__
        first = " ".join(str(e).split())[:240].rstrip(".") or type(e).__name__
        offline = (
            ""
            if os.path.isdir(name)
            else (
                "; offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set, or no network), datasets reads no Hub "
                "name: pass the dataset's folder (a clone of its Hub repository) instead"
                if _offline()
                else "; pass a dataset on the Hub (org/name) or a local dataset folder"
            )
        )
        raise DataError(f"{what} does not load: {first}{offline}") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if "train" not in loaded:
        raise DataError(f"{what} has the splits {', '.join(loaded)}, no 'train'; pass a dataset with a train split")
    return loaded


def _offline():
    from datasets import config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or config.HF_DATASETS_OFFLINE)


def missing_labels(ds, column):
    """The rows of `ds` without a label in `column`: empty, or datasets' ClassLabel value -1 ("no label")."""
    feature = ds.features.get(column)
    none = -1 if getattr(feature, "names", None) else None
    return [i for i, v in enumerate(ds[column]) if v is None or v == "" or (none is not None and v == none)]


def load_splits(inputs, label_column=None):
    """({"train", "validation"} datasets, where): `where` names the validation split's source.
    `label_column`: labelled data, where a fallback `test` split without any label is not used."""
    check_inputs(inputs)
    percentage = inputs.validation_split_percentage or 10
    if inputs.dataset_name:
        loaded, what = load_named(inputs.dataset_name, inputs.dataset_config_name), "the dataset"
    elif _one_folder(inputs.train_file):
        loaded, what = _saved(inputs.train_file[0]), f"--train_file {inputs.train_file[0]}"
    elif _one_folder(inputs.validation_file):  # files to train on, a save_to_disk folder to validate with
        return {"train": load_files(inputs.train_file)["train"], "validation": _validation(inputs)}, "--validation_file"
    else:
        splits = load_files(
            inputs.train_file, inputs.validation_file, None if inputs.validation_file else percentage, inputs.seed
        )
        where = "--validation_file" if inputs.validation_file else f"{percentage:g}% of --train_file held out"
        return splits, where
    train = loaded["train"]
    if inputs.validation_file:
        return {"train": train, "validation": _validation(inputs)}, "--validation_file"
    for split in ("validation", "test"):
        if split in loaded:
            ds = loaded[split]
            # a benchmark's hidden split: no label at all, or -1 throughout where the column is plain
            # integers (exported without its ClassLabel; elsewhere -1 is a class, as in -1/0/1 sentiment)
            hidden = (
                label_column is not None
                and label_column in ds.column_names
                and (len(missing_labels(ds, label_column)) == len(ds) or all(v == -1 for v in ds[label_column]))
            )
            if not hidden:
                return {"train": train, "validation": ds}, f"{what}'s {split} split"
            unused = f"; {what}'s {split} split has no labels"  # a benchmark's hidden test split
            break
    else:
        unused = ""
    train, validation = hold_out(train, percentage, inputs.seed)
    return {"train": train, "validation": validation}, f"{percentage:g}% of {what}'s train split held out{unused}"


def _one_folder(files):
    return bool(files) and len(files) == 1 and os.path.isdir(files[0])


def _validation(inputs):
    """--validation_file as a split: its files, or a save_to_disk folder (a Dataset, or a DatasetDict's
    `validation` split, or its only one)."""
    files = inputs.validation_file
    if not _one_folder(files):
        return load_files(files, flag="--validation_file")["train"]
    saved = _saved(files[0], "--validation_file", "validation")
    return saved["validation"]


def _saved(folder, flag="--train_file", split="train"):
    """A folder written by save_to_disk, as a DatasetDict with `split` (a Dataset, or a DatasetDict's only
    split, is taken as that split for --validation_file)."""
    import datasets

    try:
        saved = datasets.load_from_disk(folder)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(
            f"{flag} {folder} is a folder but not one written by datasets' save_to_disk "
            f"({' '.join(str(e).split())[:100]}); pass a csv/tsv/json/jsonl/parquet file"
            + (f", or --dataset_name {folder} for a dataset folder of data files" if flag == "--train_file" else "")
        ) from None
    if isinstance(saved, datasets.Dataset):
        return datasets.DatasetDict({split: saved})
    if split not in saved and flag == "--validation_file" and len(saved) == 1:
        return datasets.DatasetDict({split: next(iter(saved.values()))})
    if split not in saved:
        raise DataError(f"{flag} {folder} holds the splits {', '.join(saved)}, no {split!r}")
    return saved
