"""The run's output as a Hugging Face folder: the trained weights put into the pretrained model rebuilt
on the CPU and written with save_pretrained in --save_dtype (default: the checkpoint's own), so
`from_pretrained(OUTPUT_DIR)` loads it, no peft needed (under LoRA the adapter goes beside it, to
OUTPUT_DIR/adapter); and the check, before the first step, that nothing would stop the run's end
from writing it."""

import os
import shutil

from data.errors import fail


def save_model_folder(weights, output_dir, build, tokenizer, lora, dtype):
    """The run's model as a Hugging Face folder in `dtype`: `build()` loads the pretrained model on the
    CPU (a peft model under LoRA; its config and generation config as the source has them, and no
    random initialisation of a second copy) and takes the run's `weights`: all of them, or only those
    that trained (the frozen ones are the pretrained model's). Under LoRA the adapter goes to
    OUTPUT_DIR/adapter and the merged model to OUTPUT_DIR, so from_pretrained needs no peft."""
    model = build()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - frozen - {n for n, _ in model.named_buffers()}:
        raise RuntimeError(
            f"the run's weights do not fit the rebuilt model: unexpected {unexpected[:3]}, "
            f"missing {sorted(set(missing) - frozen)[:3]}"
        )
    if lora:
        for config in model.peft_config.values():  # where the base is, from any folder the adapter is read in
            if os.path.isdir(config.base_model_name_or_path):  # a Hub id stays as it is
                config.base_model_name_or_path = os.path.abspath(config.base_model_name_or_path)
        # no embedding layers: they are never resized here, and peft's look for a change fetches the base's config
        model.save_pretrained(os.path.join(output_dir, "adapter"), save_embedding_layers=False)
        model = model.merge_and_unload()
    model.to(dtype).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def check_savable(path, config, tokenizer):
    """Before the first step, one line for what would stop the run's end from writing its output
    folder: a config with a quantization method (transformers refuses save_pretrained of a model
    loaded with one, GGUF's included, and these scripts train no quantized base, not even under
    --lora_r), a config that does not serialize, a tokenizer that cannot be saved (tried in a
    scratch folder)."""
    import tempfile

    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        method = getattr(method, "value", method)  # an enum in transformers' own config classes
        how = (
            "python -m train.models.gguf_import --gguf_file FILE.gguf writes one from a GGUF file"
            if method == "gguf"
            else "load it, delete model.config.quantization_config and save_pretrained a model of the same class "
            "with its weights in float32 or bfloat16"
        )
        fail(
            f"--model_name_or_path {path} is quantized ({method}: quantization_config in its config.json), and "
            f"transformers refuses to save a model loaded with it, so this run could not write its output folder; "
            f"pass a dequantized copy ({how})"
        )
    try:
        config.to_json_string()
    except (TypeError, ValueError) as e:
        fail(
            f"--model_name_or_path {path}: its config does not save as JSON ({' '.join(str(e).split())[:120]}), so "
            "this run could not write its output folder; fix its config.json"
        )
    try:
        scratch = tempfile.mkdtemp(prefix="tokenizer-check-")
    except OSError:  # no temporary folder to try it in: the end will tell
        return
    try:
        tokenizer.save_pretrained(scratch)
    except Exception as e:  # whatever stops it here stops the end too
        fail(
            f"--model_name_or_path {path}: its tokenizer cannot be saved ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:120]}), so this run could not write its output folder; fix its tokenizer "
            "files, or pass a model whose tokenizer saves"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
