"""Image classifiers by name: the built-in `convnet`, small enough to train in minutes on a CPU, or
any torchvision classification model, from scratch or from a local state dict (no network needed)."""

import difflib
import json
import os
import pickle

import torch
import torch.nn as nn

from data.errors import fail


class ConvNet(nn.Module):
    """4 x [3x3 convolution, BatchNorm, ReLU, 2x2 max-pool], global average pooling, linear: any input
    of 16x16 pixels or more. 16 -> 128 channels, 15 M multiply-adds per 64x64 image."""

    def __init__(self, num_classes, channels=(16, 32, 64, 128)):
        super().__init__()
        layers, c_in = [], 3
        for c_out in channels:
            layers += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            c_in = c_out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def torchvision_models():
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)  # classification models only


def check_model_args(name, pretrained_weights=None):
    """Fail at once, in one line, on an unknown --model or a missing --pretrained_weights file."""
    names = ["convnet", *torchvision_models()]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        fail(
            f"--model {name} is neither convnet nor a torchvision classification model"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + "; python -c 'import torchvision; print(torchvision.models.list_models(module=torchvision.models))' "
            "lists them"
        )
    if pretrained_weights and not os.path.isfile(pretrained_weights):
        fail(
            f"--pretrained_weights {pretrained_weights} does not exist; pass a state dict file (.safetensors, .pth "
            "or .pt)"
        )


def build_classifier(name, num_classes, image_size):
    """A freshly initialised classifier for `num_classes` classes."""
    check_model_args(name)
    if name == "convnet":
        return ConvNet(num_classes)
    import torchvision

    kwargs = {"num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False  # their auxiliary heads return tuples in training, and need no extra loss here
    if name.startswith("vit_"):
        kwargs["image_size"] = image_size  # a ViT's position embeddings are sized for one input size
    return torchvision.models.get_model(name, weights=None, **kwargs)


def load_pretrained(model, path):
    """Load the tensors of a local state dict (.safetensors, or .pth/.pt of tensors, as torchvision's
    weight files are) whose names and shapes fit `model`; the rest keep their fresh values, e.g. a
    classifier head sized for another number of classes. Returns the names left fresh."""
    check_model_args("convnet", path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)  # a planted pickle is refused, not run
    except pickle.UnpicklingError:
        fail(
            f"--pretrained_weights {path} holds pickled objects other than tensors (a whole model saved with "
            "torch.save(model)?); save model.state_dict() instead, or as .safetensors"
        )
    except Exception as e:  # torch.load meets a non-torch file with any of KeyError, EOFError, RuntimeError, ...
        fail(f"--pretrained_weights {path} is not a .safetensors, .pth or .pt state dict ({type(e).__name__})")
    state = state.get("state_dict", state.get("model", state)) if isinstance(state, dict) else state
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not fits:
        fail(
            f"--pretrained_weights {path}: none of its {len(state)} tensors fits this --model (names or shapes "
            "differ); pass weights saved from the same architecture"
        )
    model.load_state_dict(fits, strict=False)
    return [k for k in own if k not in fits]


def load_trained_classifier(output_dir):
    """(model in eval mode, on the GPU if there is one; class names; image size) of a finished run of
    train/image_classification.py."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with open(os.path.join(output_dir, "args.json")) as f:
            trained = json.load(f)
        with open(os.path.join(output_dir, "labels.json")) as f:
            classes = json.load(f)
        weights = load_file(os.path.join(output_dir, "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        fail(
            f"--output_dir {output_dir} holds no finished image classification run ({' '.join(str(e).split())[:120]})"
            "; train one there first"
        )
    model = build_classifier(trained["model"], len(classes), trained["image_size"])
    model.load_state_dict(weights)
    return model.eval().to("cuda" if torch.cuda.is_available() else "cpu"), classes, trained["image_size"]
