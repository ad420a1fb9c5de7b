"""The accelerator every script builds, and what runs on it before training: the process group
(with its restart-safe rendezvous), the mixed precision chosen for the hardware, the header that
shows what is really running, and the main-process-first data load."""

import contextlib
import functools
import os
import sys
import tempfile
import warnings
from datetime import timedelta
from urllib.parse import urlparse

import accelerate
import torch
import yaml
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs

from data.errors import UserError, fail
from train.core.failures import use_store
from train.core.fsdp import (
    cpu_fsdp2_plugin,
    fsdp_launch,
    is_sharded,
    local_share,
    mixed_precision_policy,
    shard_model,
    swap_optimizer_params,
)
from train.core.process import launcher_argv
from train.core.tracking import tracking_kwargs


def _env_rendezvous_per_attempt(url, timeout=None, **kwargs):
    """`env://` whose store keys carry torchrun's restart attempt.

    torch 2.15's elastic agent keeps one rendezvous store for its whole life and `env://` uses it
    without a per-attempt prefix, so after `--max_restarts` restarts the workers a rank can read its
    peer's address from the dead attempt and fail ("Gloo connectFullMesh failed ... Connection
    refused"; 3 of 3 restarts in our tests, pytorch#135712 has the same root cause). A prefix per attempt
    gives every attempt fresh keys. torch has no public way to put a prefix into env://, so its
    private handler is wrapped (not replaced): registered under a new scheme, through public
    register_rendezvous_handler.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import _env_rendezvous_handler

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    query = urlparse(url).query  # torch appends rank/world_size here when it knows them
    for store, rank, world_size in _env_rendezvous_handler(f"env://?{query}", timeout=timeout, **kwargs):
        store = PrefixStore(f"attempt_{attempt}/", store)
        use_store(store)  # where a failing rank leaves its line for the others (train/core/failures.py)
        yield store, rank, world_size


def _process_group_kwargs(ddp_timeout):
    kwargs = {"timeout": timedelta(seconds=ddp_timeout)}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # launched by torchrun, so restarts are possible
        from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler

        if "envattempt" not in _rendezvous_handlers:
            register_rendezvous_handler("envattempt", _env_rendezvous_per_attempt)
        kwargs["init_method"] = "envattempt://"
    return InitProcessGroupKwargs(**kwargs)


@functools.cache
def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: nothing to tell native bf16 by, so fp32
        return []


def cpu_has_native_bf16(cpu_flags=None, capability=None, onednn_isa=None):
    """(yes, what) for the CPU's bf16: native with AVX512-BF16 or AMX, when torch and oneDNN may use
    them (ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 limit a big CPU to AVX2 kernels).
    Without native support bf16 autocast is emulated, many times slower than fp32 (docs/speed.md)."""
    cpu_flags = cpu_flags if cpu_flags is not None else _cpu_flags()
    capability = capability if capability is not None else torch.backends.cpu.get_cpu_capability()
    onednn_isa = (onednn_isa if onednn_isa is not None else os.environ.get("ONEDNN_MAX_CPU_ISA", "")).upper()
    native = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in cpu_flags]
    if not native:
        return False, f"{capability} without AVX512-BF16/AMX"
    if not capability.startswith("AVX512") or (onednn_isa and "BF16" not in onednn_isa and "AMX" not in onednn_isa):
        return False, f"{native[0]} present but kernels limited to {capability}" + (
            f", ONEDNN_MAX_CPU_ISA={onednn_isa}" if onednn_isa else ""
        )
    if onednn_isa and "AMX" not in onednn_isa and "avx512_bf16" in native:  # AMX present, held back
        return True, f"avx512_bf16, {capability}, ONEDNN_MAX_CPU_ISA={onednn_isa}"
    return True, f"{native[0]}, {capability}"


def launch_stated_precision():
    """Where the `accelerate launch` that started this process was told a mixed precision, or None.

    accelerate launch exports ACCELERATE_MIXED_PRECISION always ('no' when nothing was said), so
    the value alone cannot tell a wizard's answer 'no' from no answer. Its own sources can: its
    --mixed_precision flag, else the config file it read (its --config_file, else accelerate's
    default config file unless --cpu, as launch_command decides) holding a mixed_precision key."""
    argv = launcher_argv()
    if not argv or argv[:2] != ["accelerate", "launch"]:
        return None
    path = None
    for i, a in enumerate(argv):
        if a == "--mixed_precision" or a.startswith("--mixed_precision="):
            return "from accelerate launch --mixed_precision"
        if a == "--config_file" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config_file="):
            path = a.split("=", 1)[1]
    if path is None and "--cpu" not in argv:
        from accelerate.commands.config import default_config_file

        path = default_config_file if os.path.isfile(default_config_file) else None
    if path is None:
        return None
    try:
        with open(path) as f:
            config = yaml.safe_load(f)  # JSON too: `accelerate config default` writes JSON, even to .yaml
    except (OSError, ValueError, yaml.YAMLError):
        return None
    # accelerate reads a legacy `fp16: true` as mixed_precision fp16
    stated = isinstance(config, dict) and (config.get("mixed_precision") is not None or config.get("fp16"))
    return f"from the accelerate config {path}" if stated else None


def choose_mixed_precision(requested, on_cpu):
    """(mode, why) for --mixed_precision. `auto` yields to the launch's own answer (its config file's
    mixed_precision, 'no' included, or its --mixed_precision; an fp16/bf16 exported without either
    counts too), else bf16 where the hardware runs it natively."""
    source = "as asked"
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if requested in (None, "auto") and launched:
        stated = launch_stated_precision()
        if stated or launched != "no":
            requested, source = launched, stated or "from ACCELERATE_MIXED_PRECISION"
    if requested not in (None, "auto"):
        return requested, source
    if on_cpu:
        native, what = cpu_has_native_bf16()
        return (
            ("bf16", f"auto: native bf16 on this CPU, {what}")
            if native
            else ("no", f"auto: no native bf16 on this CPU, {what}")
        )
    if torch.cuda.is_available():
        return (
            ("bf16", "auto: the GPU supports bf16")
            if torch.cuda.is_bf16_supported()
            else ("no", "auto: the GPU has no bf16; fp16 needs loss scaling, pass --mixed_precision fp16 for it")
        )
    return "no", "auto: bf16 on this accelerator is not checked; pass --mixed_precision bf16 for it"


def check_writable(output_dir):
    """Raise the OSError (EROFS, EACCES, ENOSPC, ...) that the run's first write into output_dir would
    meet, before any process group or data load: run() turns it into one line at once, where the
    first checkpoint would have met it minutes later. A nameless 1-byte file (O_TMPFILE) in the
    folder, or in its nearest existing parent while it does not exist yet, is what is written."""
    if output_dir is None:
        return
    folder = os.path.abspath(output_dir)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"\0")
            f.flush()
    except OSError as e:
        raise OSError(e.errno, e.strerror, output_dir) from None


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator, plus FSDP2 for CPU processes launched with an FSDP2 config, which
    accelerate 1.15 runs as plain DDP (train/core/fsdp.py). Only public methods are extended, and
    they change nothing anywhere else (GPUs, DDP, one process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu_fsdp2 = cpu_fsdp2_plugin(self)

    def prepare(self, *args, device_placement=None):
        """Under CPU FSDP2, shard the model and point the optimizer at the shards before accelerate
        prepares them (it would wrap DDP around the model otherwise), as accelerate's GPU path does."""
        models = [a for a in args if isinstance(a, torch.nn.Module)] if self.cpu_fsdp2 is not None else []
        models = [m for m in models if not is_sharded(m)]
        if models:
            optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
            if len(models) != 1 or not optimizers:
                fail("under FSDP2 pass the model and its optimizer to accelerator.prepare together, one model a call")
            names = {id(p): n for n, p in models[0].named_parameters()}
            units = shard_model(self.cpu_fsdp2, models[0], self.num_processes, mixed_precision_policy(self))
            for optimizer in optimizers:
                swap_optimizer_params(optimizer, names, models[0])
            self.print(
                f"fsdp2: fully_shard over {self.num_processes} CPU processes, units: {units}; each process "
                f"holds {local_share(models[0]):.1%} of the parameters (rank 0's share)"
            )
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self.cpu_fsdp2 is not None and is_sharded(model):
            # sharded already: accelerate's autocast (under bf16, on top of FSDP2's bf16 parameters:
            # norms and softmax stay fp32; the losses take .float() of the bf16 outputs) and compile,
            # without the DDP wrapper it puts around every MULTI_CPU model (evaluation_mode skips only that)
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    @contextlib.contextmanager
    def no_sync(self, model):
        """FSDP2's form of DDP's no_sync for the CPU-sharded model: accumulation micro-batches keep
        their gradients unreduced until the last one, as accelerate does for FSDP2 on GPUs."""
        if self.cpu_fsdp2 is None or not is_sharded(self.unwrap_model(model)):  # torch.compile wraps it
            with super().no_sync(model):
                yield
            return
        sharded = self.unwrap_model(model)
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)


def make_accelerator(args, **kwargs):
    """The one Accelerator a script builds.

    cpu=True when no accelerator is visible: accelerate only forms a multi-process CPU group (gloo)
    when told cpu=True, and under torchrun (MULTI_GPU configs) the config's use_cpu never reaches the
    script, so without this a 2-process CPU launch trains two independent copies.
    The seedable sampler makes the shuffle a function of (seed, epoch) alone: the same on every rank
    and reproducible on resume. The scheduler is stepped by the loop once per optimizer step, so
    its state does not depend on the process count and survives a resume with another one.
    DDP's broadcast_buffers is off: broadcasting BatchNorm statistics before every forward costs a
    large part of a CPU step (docs/speed.md); evaluation averages them over ranks first (evaluation.average_buffers).
    --with_tracking's trackers are set up here, so no script can accept the flag and write nothing.
    """
    # torch 2.15 renames broadcast_buffers to forward_sync_buffers, which accelerate 1.15's
    # DistributedDataParallelKwargs cannot pass; the warning itself says to keep broadcast_buffers=False
    # until then, so it is silenced, and only it
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    check_writable(args.output_dir)
    cpu = args.cpu or not torch.accelerator.is_available()
    if cpu and fsdp_launch() and os.environ.get("FSDP_VERSION", "1") != "2":  # accelerate's FSDP1 plugin needs a GPU
        fail(
            "the accelerate config asks for FSDP version 1, which runs on GPUs only; for CPU processes set "
            "fsdp_version: 2 in its fsdp_config, as accelerate_configs/fsdp2_cpu_2proc.yaml does"
        )
    return Accelerator(
        cpu=cpu,
        mixed_precision=choose_mixed_precision(args.mixed_precision, cpu)[0],
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed, non_blocking=True),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[
            _process_group_kwargs(args.ddp_timeout),
            DistributedDataParallelKwargs(broadcast_buffers=False),
        ],
        **{**tracking_kwargs(args.with_tracking, args.report_to, args.output_dir), **kwargs},
    )


# how long the other processes wait for the main process's data work (tokenizing a large dataset, say): as
# long as it takes, not --ddp_timeout, which bounds a training step's collectives
PATIENT_WAIT = timedelta(days=7)


@functools.cache
def _patient_group():
    """A gloo group over every process whose collectives wait PATIENT_WAIT; made once, by every rank."""
    return torch.distributed.new_group(backend="gloo", timeout=PATIENT_WAIT)


def gather_patiently(accelerator, value):
    """Every process's `value` (any picklable object), in rank order, on every process; waiting for
    the slowest as long as it takes (its share of a pass over the data, say), not --ddp_timeout."""
    if accelerator.num_processes == 1:
        return [value]
    values = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(values, value, group=_patient_group())
    return values


def main_process_first(accelerator, load, share=False):
    """load() on the main process, then on the others: one process downloads or writes files, the
    others read them. With share=True the others receive the main process's result instead (a
    folder scanned once, the same list on every rank). If the main process meets a user's error,
    every process stops with its message, instead of the others timing out in a barrier with a
    traceback of their own. The others wait as long as load() takes, past --ddp_timeout."""
    result, message = None, None
    if accelerator.is_main_process:
        try:
            result = load()
        except UserError as e:
            message = str(e)
    if accelerator.num_processes > 1:
        shared = [message, result if share else None]
        torch.distributed.broadcast_object_list(shared, src=0, group=_patient_group())
        message, result = shared[0], shared[1] if share else result
    if message is not None:
        fail(message)
    return result if accelerator.is_main_process or share else load()


def announce(accelerator, per_device_train_batch_size, gradient_accumulation_steps, mixed_precision):
    """One line per process, then a header from the main process: what is really running, so a
    wrong launch (two independent world-size-1 runs, say) shows at once."""
    # one write() per line, so lines from different processes do not interleave mid-line
    sys.stdout.write(
        f"process {accelerator.process_index}/{accelerator.num_processes} pid={os.getpid()} "
        f"device={accelerator.device}\n"
    )
    sys.stdout.flush()
    accelerator.wait_for_everyone()
    on_cpu = accelerator.device.type == "cpu"
    global_batch_size = per_device_train_batch_size * accelerator.num_processes * gradient_accumulation_steps
    why = choose_mixed_precision(mixed_precision, on_cpu)[1]
    layout = "FSDP2 on CPU" if getattr(accelerator, "cpu_fsdp2", None) else accelerator.distributed_type.value
    accelerator.print(
        f"world_size={accelerator.num_processes} device={accelerator.device.type} "
        f"distributed_type={layout} "
        f"mixed_precision={accelerator.mixed_precision} ({why}) global_batch_size={global_batch_size} "
        f"threads_per_process={torch.get_num_threads()}"
    )
    if accelerator.mixed_precision == "bf16" and on_cpu and not cpu_has_native_bf16()[0]:
        accelerator.print(
            f"warning: bf16 on a CPU without native bf16 ({cpu_has_native_bf16()[1]}) is emulated, "
            "many times slower than fp32; --mixed_precision auto (the default) picks fp32 here"
        )
    if (
        fsdp_launch()
        and accelerator.distributed_type.value != "FSDP"
        and getattr(accelerator, "cpu_fsdp2", None) is None
    ):
        accelerator.print(
            f"warning: the config asks for FSDP, but this run is {accelerator.distributed_type.value} "
            f"with {accelerator.num_processes} process(es): nothing is sharded"
        )
    # accelerate launch exports MASTER_ADDR only when asked for several processes; a MULTI_CPU config
    # or --cpu --num_processes N without an MPI hostfile then starts one plain process, and accelerate
    # exposes nothing else that tells it (no WORLD_SIZE, no requested count)
    launched_alone = (
        "MASTER_ADDR" in os.environ
        and "ACCELERATE_MIXED_PRECISION" in os.environ
        and not any(
            name in os.environ for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
        )
    )
    if accelerator.num_processes == 1 and launched_alone:
        accelerator.print(
            "warning: the launch asked for several processes but this is ONE (world_size=1): accelerate "
            "starts a MULTI_CPU config or --cpu --num_processes N as a single process unless it has an "
            "MPI hostfile; use accelerate_configs/cpu_2proc.yaml, or answer multi-GPU in `accelerate "
            "config` (our scripts run it as CPU processes when there is no GPU)"
        )
