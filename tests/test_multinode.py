"""Two nodes on one machine: two `accelerate launch` processes, machine ranks 0 and 1, 2 CPU processes
each, rendezvous on 127.0.0.1. They must form one world of 4 and train as one node does: to the
weights one process reaches with the same global batch, within float rounding (1e-6, the bound of
tests/test_regression.py, whose controls miss it by more than 1e-3; 4 processes measured 1.2e-7 from
1). Both rendezvous styles, from the repo's own 2-node templates. Nodes on hosts with their own
addresses, under SLURM: tests/test_cluster.py."""

import os
import socket
import sys

import pytest
import yaml

from conftest import CONFIGS, clean_env, run_main, run_together
from test_checkpointing import largest_difference, weights

# the same 32 samples per step, as the nodes work it out: 32 / (4 processes x 1 accumulation step)
GLOBAL = ["--global_batch_size", 32, "--max_train_steps", 20, "--seed", 11]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_config(template, tmp_path):
    """The template with the edits its comments ask for, for 2 CPU processes per 'node' here."""
    config = yaml.safe_load(open(os.path.join(CONFIGS, template + ".yaml")))
    config.update(
        num_processes=4, main_process_ip="127.0.0.1", main_process_port=free_port(), use_cpu=True, mixed_precision="no"
    )
    path = tmp_path / f"{template}_loopback.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def two_nodes(config_path, script, *args):
    # one command for both nodes, as the README says; --machine_rank overrides the file
    return run_together(
        [
            (
                [
                    sys.executable,
                    "-m",
                    "accelerate.commands.launch",
                    "--config_file",
                    str(config_path),
                    "--machine_rank",
                    str(rank),
                    os.path.join("train", script + ".py"),
                    *map(str, args),
                ],
                clean_env(),
            )
            for rank in (0, 1)
        ]
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference, in the test's process: one process, batch 32 (a 4-process launch cost 4 ranks'
    start-up for weights equal to these to 1.2e-7)."""
    out = tmp_path_factory.mktemp("regression")
    run_main(
        "regression", "--per_device_train_batch_size", 32, "--max_train_steps", 20, "--seed", 11, "--output_dir", out
    )
    return weights(out)


# each rendezvous style once, with the cheapest script: what is tested is the world the nodes form
@pytest.mark.parametrize("template", ["2node_8gpu_c10d", "2node_8gpu"], ids=["c10d", "static"])
def test_two_loopback_nodes_equal_one_node(one_process, tmp_path, template):
    config = loopback_config(template, tmp_path)
    out = tmp_path / "out"
    codes, outputs = two_nodes(config, "regression", *GLOBAL, "--output_dir", out)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for rank in range(4):
        assert any(f"process {rank}/4 " in o for o in outputs)
    assert "world_size=4 " in outputs[0]
    assert largest_difference(weights(out), one_process) < 1e-6


def test_global_batch_size_that_does_not_divide_is_one_line(capsys, tmp_path):
    from conftest import run_as_script

    proc = run_as_script(
        capsys,
        "regression",
        "--global_batch_size",
        25,
        "--gradient_accumulation_steps",
        2,
        "--output_dir",
        tmp_path / "out",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert (
        "--global_batch_size 25 is not a multiple of 1 processes x 2 accumulation steps; pass a multiple of 2"
        in proc.stderr + proc.stdout
    )


def test_a_lost_peer_is_named_from_gloos_error():
    """gloo's errors when a peer's process dies (tests/test_cluster.py sees them for real)."""
    import socket

    from train.core.run import lost_peer

    here = socket.gethostname()
    closed = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [{}]:30894. This"
    reset = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [{}]:17025: Connection reset by peer."
    )
    assert lost_peer(RuntimeError(closed.format("192.0.2.7"))) == "192.0.2.7"  # no name known: the address
    name = socket.gethostbyaddr("127.0.0.1")[0]
    expected = f"another process of this node ({here})" if name == here else f"{name} (127.0.0.1)"
    assert lost_peer(RuntimeError(reset.format("127.0.0.1"))) == expected
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
