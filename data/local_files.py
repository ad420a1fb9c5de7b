"""A user's local files (csv/tsv, json/jsonl, parquet, txt) as rows: read with the Hugging Face
`datasets` local loaders (offline; columns and types as `datasets.load_dataset(...)` gives them), an
optional seeded validation split, and the checks that a column can become what training needs.

prepare_files writes them as parquet shards (python -m data.prepare --train_file ...); text files
for a language model go through data/text.py's prepare_text instead.
"""

import os
import shutil

from data.atomic_folder import WRITE_FIXES, atomic_folder, report, up_to_date
from data.errors import DataError
from data.shards import fingerprint, hash_files, read_manifest, write_manifest, write_table_shards

LOADERS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}


def check_files(paths, flag):
    """The datasets loader for `paths` (one kind of file per flag), or DataError naming the problem."""
    kinds = set()
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{flag} {path} does not exist; pass a csv/tsv, json/jsonl, parquet or txt file")
        extension = os.path.splitext(path)[1].lower()
        if extension not in LOADERS:
            raise DataError(
                f"{flag} {path}: unknown file type {extension or '(none)'!r}; "
                f"use one of {', '.join(LOADERS)} (or an image folder with --train_dir)"
            )
        if os.path.getsize(path) == 0:
            raise DataError(f"{flag} {path} is empty; pass a file with at least one row")
        kinds.add((LOADERS[extension], extension == ".tsv"))
    return kinds


def file_kind(train_files, validation_files=None, flag="--train_file"):
    """(datasets loader, tab-separated?) of the input files, which must all be of one kind."""
    kinds = check_files(train_files, flag) | check_files(validation_files or [], "--validation_file")
    if len(kinds) > 1:
        raise DataError(
            "--train_file and --validation_file are different kinds of file; convert one so both are "
            "csv, tsv, json/jsonl, parquet or txt"
        )
    return kinds.pop()


def load_files(
    train_files, validation_files=None, validation_split_percentage=None, seed=0, cache_dir=None, flag="--train_file"
):
    """{"train": datasets.Dataset, "validation": datasets.Dataset or None} from local files, through
    datasets' local loaders (offline). With validation_split_percentage, a seeded random P% of the
    training rows is held out. `flag` names train_files in errors (--validation_file, where those are
    a validation split's files alone)."""
    import datasets

    datasets.disable_progress_bars()  # one line per split per run; our own line says what was written
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is reported once, below
    builder, tsv = file_kind(train_files, validation_files, flag)
    data_files = {"train": list(train_files), **({"validation": list(validation_files)} if validation_files else {})}
    try:
        loaded = datasets.load_dataset(
            builder, data_files=data_files, cache_dir=cache_dir, **({"delimiter": "\t"} if tsv else {})
        )
    except Exception as e:  # the loaders raise many types, wrapped; the innermost says what was wrong
        while e.__cause__ is not None:
            e = e.__cause__
        if isinstance(e, OSError) and e.errno in WRITE_FIXES:  # writing its cache (in the output's temporary
            raise e from None  # folder) failed: a disk fault, not the file's
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        for split, files in data_files.items():
            if f'Instruction "{split}" corresponds to no data' in first:  # a csv of its header alone, say
                named = flag if split == "train" else "--validation_file"
                raise DataError(f"{named} {', '.join(files)} has no rows; pass a file with data") from None
        raise DataError(
            f"could not read {', '.join(train_files + (validation_files or []))} as {builder}: "
            f"{first}; check the file's format"
        ) from None
    train, validation = loaded["train"], loaded.get("validation")
    if len(train) == 0:
        raise DataError(f"{flag} {', '.join(train_files)} has no rows; pass a file with data")
    if validation_split_percentage is not None:
        train, validation = hold_out(train, validation_split_percentage, seed)
    return {"train": train, "validation": validation}


def hold_out(train, validation_split_percentage, seed):
    """(train, validation): a seeded random P% of the rows held out, at least one, never all."""
    held = max(1, round(len(train) * validation_split_percentage / 100))
    if held >= len(train):
        raise DataError(
            f"--validation_split_percentage {validation_split_percentage} of {len(train)} rows leaves "
            "no training rows; pass a smaller percentage or more data"
        )
    parts = train.train_test_split(test_size=held, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def check_columns(splits, text_columns):
    """The tabular path (--train_file without --tokenizer): its shards are read as tensors
    (ParquetSource's default decode), so a column that cannot become one is refused here, naming it,
    rather than failing in training: numbers (no empty values), lists of numbers and bytes pass;
    strings only where named by --text_column (default `text`), for a decode step that tokenizes them."""
    import pyarrow as pa

    def numeric(kind):
        return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)

    for split, ds in splits.items():
        if ds is None:
            continue
        for field in ds.data.schema:
            name, kind = field.name, field.type
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                if name in text_columns:
                    continue
                raise DataError(
                    f"column {name!r} of the {split} data holds text, which cannot become a tensor; "
                    f"encode it as numbers (e.g. one id per category) before preparing, or pass "
                    f"--text_column {name} to keep it as strings for a decode step that tokenizes it"
                )
            if numeric(kind) or (
                (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
                and numeric(kind.value_type)
            ):
                if nulls := ds.data.column(name).null_count:
                    raise DataError(
                        f"column {name!r} of the {split} data has {nulls} empty value(s), which a tensor "
                        "cannot hold; fill them in or drop those rows"
                    )
            elif not (
                pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)
            ):
                raise DataError(
                    f"column {name!r} of the {split} data holds {kind}, which cannot become a tensor; "
                    "encode it as numbers before preparing"
                )


def text_column(splits, column):
    """The `column` of each split as a list of strings, or DataError naming the columns there are."""
    out = {}
    for split, ds in splits.items():
        if ds is None:
            continue
        if column not in ds.column_names:
            raise DataError(
                f"no column {column!r} in the {split} data (columns: {', '.join(ds.column_names)}); "
                "pass --text_column NAME"
            )
        if str(ds.features[column]) not in ("Value('string')", "Value('large_string')"):
            raise DataError(
                f"column {column!r} holds {ds.features[column]}, not text; pass --text_column NAME of a text column"
            )
        out[split] = [t or "" for t in ds[column]]
    return out


def prepare_files(
    train_files,
    output_dir,
    validation_files=None,
    validation_split_percentage=None,
    num_shards=8,
    rows_per_group=32,
    seed=0,
    text_columns=("text",),
    force=False,
):
    """Local files → parquet shards + manifest in output_dir (atomically, unless already up to date).
    Every column must be able to become a tensor (check_columns) but `text_columns`, kept as strings."""
    file_kind(train_files, validation_files)  # bad input fails before the inputs are hashed
    inputs = hash_files(list(train_files) + list(validation_files or []))
    arguments = {
        "validation_split_percentage": validation_split_percentage,
        "num_shards": num_shards,
        "rows_per_group": rows_per_group,
        "seed": seed,
        "kind": "files",
    }
    if up_to_date(output_dir, inputs, arguments, force):
        return read_manifest(output_dir)
    with atomic_folder(output_dir, force, fingerprint(inputs, arguments)) as tmp:
        splits = load_files(
            list(train_files),
            list(validation_files or []) or None,
            validation_split_percentage,
            seed,
            cache_dir=os.path.join(tmp, ".cache"),
        )
        check_columns(splits, text_columns)
        for split, ds in splits.items():
            if ds is not None:  # with_format("arrow") slices are Arrow tables, indices mapping applied
                write_table_shards(ds.with_format("arrow")[:], tmp, split, num_shards, rows_per_group)
        shutil.rmtree(os.path.join(tmp, ".cache"), ignore_errors=True)
        manifest = write_manifest(tmp, inputs, arguments)
    report(output_dir, manifest)
    return manifest
