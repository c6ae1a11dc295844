"""FSDP2 (`fully_shard`) for a model the Trainer trains and for a frozen model run beside it (a healing's teacher).

A model is sharded block by block (each of its `_no_split_modules` but the one holding the input embeddings, e.g.
every `NormSwapLayer`), then as a whole: the root's unit holds the embeddings, the final norm and a language-model head
(tied or not), which stay together. Only the main process reads the weights of a model sharded here; the others build
it empty and take their shards from it. On accelerators the Trainer's own FSDP2 (through accelerate) shards the
trained model, which the main process alone reads too (accelerate's `cpu_ram_efficient_loading`); on CPU accelerate
takes no FSDP plugin (it trains with DDP instead), so the model is sharded here and marked as owning its placement and
gradient reduction, which keeps the Trainer from wrapping it in DDP.
"""

import itertools

import torch
import torch.distributed as dist
import transformers
from accelerate.utils import DistributedType, parse_flag_from_env
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..devices import compute_device
from ..memory import release_freed_memory
from ..model.evaluation_mode import evaluation_mode
from .collectives import from_main_process
from .options import ShardingError, ShardingOptions
from .private_internals import TRAINER_KEEPS_SHARDED_MODELS, mark_sharded_at_load, record_outputs
from .processes import is_main_process, processes, world_size


def accelerate_shards() -> bool:
    """Whether the Trainer shards the trained model itself (accelerate's FSDP plugin): on accelerators only."""
    return torch.accelerator.is_available()


def sharded(options: ShardingOptions) -> bool:
    """Whether `options` shard: with `fsdp`, across the processes of a distributed launch, or under `accelerate
    launch` with an FSDP configuration whatever the process count (the Trainer shards the trained model there even
    in one process, so the teacher is sharded alike)."""
    state = processes()
    launched = state.distributed_type != DistributedType.NO  # by torchrun or accelerate launch
    shards = options.fsdp and (state.num_processes > 1 or (launched and parse_flag_from_env("ACCELERATE_USE_FSDP")))
    if shards and not accelerate_shards() and not TRAINER_KEEPS_SHARDED_MODELS:
        raise ShardingError(f"fsdp on CPU needs transformers>=5.19 (found {transformers.__version__}): upgrade it")
    return shards


def loads_weights(options: ShardingOptions, trained: bool = False) -> bool:
    """Whether this process reads a model's weights: every process unless `options` shard; sharded, the main process
    alone, the others building the model empty (`empty_model`) for `shard`, or for accelerate's FSDP2 (a `trained`
    model on accelerators), to hand them their shards. Every process reads a trained model that accelerate shards
    under an `fsdp_config` that turns `cpu_ram_efficient_loading` off."""
    if not sharded(options) or is_main_process():
        return True
    if not (trained and accelerate_shards()) or options.reads_trained_once():
        return False
    if parse_flag_from_env("FSDP_CPU_RAM_EFFICIENT_LOADING"):  # Transformers would then load it only in part
        raise ShardingError(
            f"fsdp_config={options.fsdp_config!r} turns cpu_ram_efficient_loading off, the launch's accelerate "
            "configuration on (fsdp_cpu_ram_efficient_loading): make them agree"
        )
    return True


def shard(model: torch.nn.Module, bf16: bool = False) -> torch.nn.Module:
    """`model` sharded in place across the processes: each block its own FSDP2 unit, then the root; in bfloat16
    mixed precision with `bf16` (gradients reduced in float32). Every process's shards and buffers are the main
    process's model's: the others may hold it empty (its parameters on the meta device)."""
    release_freed_memory()
    handed_out = world_size() > 1
    whole = dict(model.named_parameters()) if handed_out and is_main_process() else {}  # a tied one once
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if policy else {}
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if handed_out:
        _take_main_weights(model, whole)
    del whole
    record_outputs(model)
    run_whole_once(model)
    mark_sharded_at_load(model)
    release_freed_memory()  # the whole weights, freed
    return model


def _take_main_weights(model: torch.nn.Module, whole: dict) -> None:
    """Sets every process's shards of the sharded `model`, and its buffers, to the main process's: its `whole`
    parameters (empty elsewhere), one tensor at a time; a process that built `model` empty allocates its shards
    first."""
    if any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        model.to_empty(device=processes().device)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)  # buffers: below
    set_model_state_dict(model, whole, options=broadcast)
    for buffer in model.buffers():  # those outside the state dict too (e.g. rotary frequencies)
        dist.broadcast(buffer, src=0)


def take_main_dtypes(model: torch.nn.Module) -> None:
    """Casts the parameters of `model` to the dtypes of the main process's copy (on the main process nothing
    changes): a model built empty elsewhere takes the dtypes `from_pretrained` picked for the main process's, from
    the checkpoint, which sharding copies into shards of its own dtypes. Every process must call it."""
    parameters = list(model.parameters())
    main = torch.tensor([DTYPES.index(parameter.dtype) for parameter in parameters]) if is_main_process() else None
    codes = from_main_process(main, (len(parameters),))
    for parameter, code in zip(parameters, codes.tolist()):
        if parameter.dtype != DTYPES[code]:
            parameter.data = parameter.data.to(DTYPES[code])


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def run_whole_once(model: torch.nn.Module) -> None:
    """Runs the sharded `model` once whole on one token, then reshards every unit: FSDP2 takes the first unit that
    runs forward for the root, so that its submodules (`base_model`, a head) may run alone after. Every process must
    call it."""
    with torch.no_grad(), evaluation_mode(model):
        model(input_ids=torch.ones(1, 1, dtype=torch.long, device=compute_device(model)))
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of `model`: modules of its `_no_split_modules` classes, but the one holding the input
    embeddings (the root's unit keeps them with a head that may be tied to them)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    embeddings = model.get_input_embeddings()
    return [
        module
        for module in model.modules()
        if type(module).__name__ in names and not any(m is embeddings for m in module.modules())
    ]


def block_class_names(model: torch.nn.Module) -> list[str]:
    """The class names of `blocks(model)`: what accelerate wraps as units."""
    return sorted({type(module).__name__ for module in blocks(model)})


def prepare_trained(model: torch.nn.Module, options: ShardingOptions) -> torch.nn.Module:
    """The model the Trainer trains: sharded here on CPU, left to the Trainer on accelerators (built empty, with
    storage for its parameters: see `_give_storage`)."""
    if sharded(options) and not accelerate_shards():
        shard(model, bf16=options.bf16)
    elif sharded(options):
        _give_storage(model)
    return model


def _give_storage(model: torch.nn.Module) -> None:
    """Gives the parameters that `model` holds on the meta device (built empty) storage on the CPU, uninitialised:
    accelerate's FSDP2 tells parameters apart by their storage's address when it hands the optimizer the sharded ones
    (on the meta device all share address 0), then writes the main process's weights into the shards. Pages never
    written take no memory (under mixed precision accelerate writes a float32 copy of trainable parameters held in
    another dtype); the buffers, built, are kept."""
    given = {}
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                if id(parameter) not in given:  # a tied parameter once
                    storage = torch.empty_like(parameter, device="cpu")
                    given[id(parameter)] = torch.nn.Parameter(storage, requires_grad=parameter.requires_grad)
                setattr(module, name, given[id(parameter)])


def prepare_frozen(model: torch.nn.Module, options: ShardingOptions) -> torch.nn.Module:
    """A model that only runs forward beside the trained one (a teacher): in evaluation mode, without gradients,
    sharded across the processes with `fsdp`, its root unit too resharded after every forward."""
    model.eval().requires_grad_(False)
    if sharded(options):
        if accelerate_shards() and not next(model.parameters()).is_meta:
            model.to(processes().device)
        shard(model, bf16=options.bf16)
        model.set_reshard_after_forward(True, recurse=False)  # FSDP2 would keep its root gathered for a backward
    return model


def resumable(options: ShardingOptions) -> bool:
    """Whether the Trainer can keep resumable checkpoints of a training with `options`: not of a model sharded here."""
    return not sharded(options) or accelerate_shards()
